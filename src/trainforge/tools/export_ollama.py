"""An Ollama Modelfile for an exported GGUF: FROM the file, TEMPLATE from the run's chat template (as a Go
template), PARAMETER stop from the template's end-of-turn text.

Ollama's templates are Go templates over ``.Messages`` (each with ``.Role`` and ``.Content``), not Jinja.
The common chat shape, where every turn is written as ``PREFIX(role) + content + SUFFIX(role)`` and a reply
is prompted with a fixed text, is found by rendering the Jinja template on marker turns and then checked on
other conversations: the Go template is written only when the shape reproduces every rendering exactly.
Anything else (a template that merges the system prompt into the first user turn, adds a default system
prompt, trims or rewrites the content, or handles tools) cannot be written this way: the Modelfile then has
no TEMPLATE and the caller warns, and Ollama uses the GGUF's own chat template metadata where it can.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Render = Callable[[list[dict[str, str]], bool], str]  # (messages, add_generation_prompt) -> text

MARK = {"system": "TFSYS7q", "user": "TFUSR7q", "assistant": "TFAST7q"}
ROLES = ("system", "user", "assistant")


@dataclass
class ChatShape:
    """A chat template's per-role wrapping: ``lead + Σ prefix[role] + content + suffix[role] (+ generation)``."""

    lead: str
    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        body = "".join(self.prefix[m["role"]] + m["content"] + self.suffix[m["role"]] for m in messages)
        return self.lead + body + (self.generation if add_generation_prompt else "")

    @property
    def end_of_turn(self) -> str:
        """The text closing an assistant turn (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``)."""
        return self.suffix["assistant"].strip()


def _turn(role: str, n: int = 1) -> dict[str, str]:
    return {"role": role, "content": f"{MARK[role]}{n}"}


def chat_shape(render: Render, bos_token: str | None) -> ChatShape | None:
    """The template's per-role wrapping, or None when no such wrapping reproduces it."""
    try:
        return _derive(render, bos_token)
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    except Exception:  # noqa: BLE001 - a template that raises on these turns (jinja's TemplateError): not expressible
        return None


def _derive(render: Render, bos_token: str | None) -> ChatShape | None:
    u, a, s = _turn("user"), _turn("assistant"), _turn("system")
    one = render([u], False)
    lead = bos_token if bos_token and one.startswith(bos_token) else ""
    before, after = one[len(lead):].split(u["content"])
    prefix, suffix = {"user": before}, {"user": after}
    prompted = render([u], True)
    if not prompted.startswith(one):
        return None
    generation = prompted[len(one):]
    pair = render([u, a], False)
    between, suffix["assistant"] = pair.split(u["content"])[1].split(a["content"])
    if not between.startswith(suffix["user"]):
        return None
    prefix["assistant"] = between[len(suffix["user"]):]
    with_system = render([s, u], False)
    head, rest = with_system[len(lead):].split(s["content"])
    prefix["system"] = head
    gap = rest.split(u["content"])[0]
    if not gap.endswith(prefix["user"]):
        return None
    suffix["system"] = gap[: len(gap) - len(prefix["user"])]
    shape = ChatShape(lead, prefix, suffix, generation)
    checks = [([s, u, a, _turn("user", 2)], True), ([u, a, _turn("user", 2), _turn("assistant", 2)], False),
              ([s, u, a], False), ([u, a, _turn("user", 2)], True)]
    if any(render(turns, gen) != shape.render(turns, gen) for turns, gen in checks):
        return None
    return shape


def go_template(shape: ChatShape, add_bos: bool) -> str | None:
    """The Go template for ``shape`` (None when its text cannot sit in one: Go delimiters, triple quotes).
    A leading BOS is dropped when llama.cpp adds it itself (``add_bos``), as it would appear twice."""
    lead = "" if add_bos else shape.lead
    pieces = [lead, shape.generation, *shape.prefix.values(), *shape.suffix.values()]
    if any("{{" in p or "}}" in p or '"""' in p for p in pieces):
        return None
    branches = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{shape.prefix[role]}{{{{ .Content }}}}{shape.suffix[role]}'
        for i, role in enumerate(ROLES)
    )
    return f"{lead}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{shape.generation}"


def modelfile_text(gguf_path: Path, directory: Path, template: str | None, stops: list[str]) -> str:
    """The Modelfile: FROM the GGUF (relative to the Modelfile's directory), TEMPLATE, PARAMETER stop lines."""
    relative = os.path.relpath(Path(gguf_path).resolve(), Path(directory).resolve())
    source = relative if relative.startswith(("/", ".")) else f"./{relative}"
    lines = [f"FROM {source}"]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    for stop in stops:
        lines.append(f"PARAMETER stop {_quoted(stop)}")
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ollama_files(gguf_path: Path, directory: Path, render: Render | None, bos_token: str | None,
                 add_bos: bool) -> tuple[str, list[str]]:
    """(the Modelfile's text, warnings): ``render`` is None for a model without a chat template."""
    if render is None:
        return modelfile_text(gguf_path, directory, None, []), [
            "the run has no chat template: the Modelfile has no TEMPLATE (Ollama passes prompts as they are)"]
    shape = chat_shape(render, bos_token)
    template = go_template(shape, add_bos) if shape is not None else None
    if template is None:
        why = ("the run's chat template is not the plain role/content shape a Go template can express (a default "
               "system prompt, merged or rewritten turns, tools): the Modelfile has no TEMPLATE; write one by hand")
        return modelfile_text(gguf_path, directory, None, []), [why]
    stops = [shape.end_of_turn] if shape.end_of_turn else []
    return modelfile_text(gguf_path, directory, template, stops), []
