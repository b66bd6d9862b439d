"""YAML of a run config (a file, or one ``--set`` value) read with limits: hostile input ends in a ``ConfigError``.

PyYAML alone expands aliases without bound (ten anchors of ten references each: 10^10 values), recurses
once per nesting level (``RecursionError``) and builds ints of any length (``ValueError`` past 4300 digits).
``load_yaml`` composes the document, then checks it before anything is built from it: at most
``MAX_VALUES`` values counted with every alias expanded (aliases and merge keys of ordinary size still
work), at most ``MAX_DEPTH`` levels of nesting, no integer of more than ``MAX_INT_DIGITS`` digits, no key given
twice in one mapping (PyYAML would keep the last silently). Each
refusal names the source, its line and the key. ``read_config_text`` reads a config file: a regular file
of at most ``MAX_FILE_BYTES`` bytes of UTF-8 text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, clip

MAX_VALUES = 100_000
"""Values (scalars, lists, mappings) a document may hold, every alias expanded; a real config holds a few hundred."""
MAX_DEPTH = 64
"""Levels of nesting; a real config nests five or six (model.init's rope_scaling)."""
MAX_INT_DIGITS = 100
"""Digits of an integer; a 64-bit value has 20, and no setting takes more."""
MAX_FILE_BYTES = 4 * 1024 * 1024
"""Bytes of a config file; a config is a few kilobytes of YAML."""

_INT_TAG = "tag:yaml.org,2002:int"


class InvalidYaml(ConfigError):
    """Text that is not YAML (a ``--set`` value of it is taken as text); over a limit is a plain ``ConfigError``."""


def read_config_text(path: Path) -> str:
    """The text of the config file ``path``; a ``ConfigError`` saying what it is when it is no YAML text file."""
    shown = clip(str(path))
    try:
        if path.is_dir():
            inside = path / "config.yaml"
            hint = f"; a run directory's config is {clip(str(inside))}" if inside.is_file() else ""
            raise ConfigError(f"{shown} is a directory; give a YAML config file (CONFIG is a file, e.g. config.yaml){hint}")
        if not path.exists():
            raise ConfigError(f"config file not found: {shown}")
        if not path.is_file():
            raise ConfigError(f"{shown} is not a regular file (a device, pipe or socket); give a YAML config file")
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                f"{shown}: {size / 2**20:.1f} MiB is too large for a config (at most {MAX_FILE_BYTES // 2**20} MiB; a config "
                "is a few KB of YAML); is it a data file? Data goes in data.train"
            )
        raw = path.read_bytes()[: MAX_FILE_BYTES + 1]
    except OSError as e:
        raise ConfigError(f"{shown}: cannot read the config file: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{shown}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "a config is a YAML text file; is it a binary or data file?"
        ) from None


def load_yaml(text: str, source: str, lines: bool = True) -> tuple[Any, yaml.Node | None]:
    """The value of the YAML document ``text`` and its composed node (for key lines), within the limits.

    ``source`` names the input in messages (a file name, with ``lines``; or ``--set KEY``). Raises ``ConfigError`` for
    invalid YAML and for a document over a limit; never ``RecursionError`` or ``ValueError``."""
    loader = yaml.SafeLoader(text)
    loader.name = source  # marks in PyYAML's messages name the input, not "<unicode string>"
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(f"{source}: nested too deeply (more than {MAX_DEPTH} levels)") from None
        except yaml.YAMLError as e:
            raise InvalidYaml(f"{source}: not valid YAML: {clip(str(e), 600)}") from None
        if node is None:
            return None, None
        _check(node, source, lines)
        try:
            return loader.construct_document(node), node
        except (RecursionError, ValueError, OverflowError) as e:  # the checks above leave none; never a traceback
            raise ConfigError(f"{source}: cannot read the YAML value: {clip(str(e))}") from None
        except yaml.YAMLError as e:
            raise InvalidYaml(f"{source}: not valid YAML: {clip(str(e), 600)}") from None
    finally:
        loader.dispose()


def _check(root: yaml.Node, source: str, lines: bool) -> None:
    """Refuse a composed document over ``MAX_VALUES`` (aliases expanded), ``MAX_DEPTH`` or ``MAX_INT_DIGITS``."""
    sizes: dict[int, int] = {}  # id(node) -> values under it, aliases expanded: each node counted once per node

    def where(node: yaml.Node, path: tuple[str, ...]) -> str:
        key = f"{clip('.'.join(path), 120)}: " if path else ""
        return f"{source}, line {node.start_mark.line + 1}: {key}" if lines else f"{source}: {key}"

    def size(node: yaml.Node, path: tuple[str, ...]) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if len(path) > MAX_DEPTH:
            raise ConfigError(
                f"{where(node, path[:4])}nested too deeply (more than {MAX_DEPTH} levels), or an alias refers to itself"
            )
        total = 1
        if isinstance(node, yaml.ScalarNode):
            if node.tag == _INT_TAG and len(node.value) > MAX_INT_DIGITS:
                raise ConfigError(
                    f"{where(node, path)}an integer of {len(node.value)} characters; no setting takes more than "
                    f"{MAX_INT_DIGITS} digits"
                )
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += size(item, (*path, str(i)))
        elif isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for key_node, value_node in node.value:
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                if isinstance(key_node, yaml.ScalarNode) and name != "<<":
                    # PyYAML keeps the last of two equal keys: a second `train:` section would silently drop the first
                    if name in seen:
                        first = f" (first on line {seen[name].start_mark.line + 1})" if lines else ""
                        raise ConfigError(
                            f"{where(key_node, (*path, str(name)))}given twice{first}; YAML keeps only the last, "
                            "so the first would be ignored: merge the two into one"
                        )
                    seen[name] = key_node
                total += size(key_node, path) + size(value_node, (*path, str(name)))
        if total > MAX_VALUES:
            raise ConfigError(
                f"{where(node, path)}holds more than {MAX_VALUES} values with its aliases (*name) expanded; "
                "a YAML alias bomb? Write the values out"
            )
        sizes[id(node)] = total
        return total

    size(root, ())
