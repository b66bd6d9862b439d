"""An Ollama Modelfile for an exported GGUF: FROM the file, TEMPLATE from the run's chat template (as a Go
template), PARAMETER stop from the template's end-of-turn text.

Ollama's templates are Go templates over ``.Messages`` (each with ``.Role`` and ``.Content``), not Jinja.
The common chat shapes are found by rendering the Jinja template on marker turns and then checked on other
conversations: the Go template is written only when the shape reproduces every rendering exactly. A turn is
``PREFIX(role) + content + SUFFIX(role)`` and a reply is prompted with a fixed text; the system prompt is

- its own turn (ChatML, Llama 3, Zephyr),
- merged into the first user turn (Llama 2's ``[INST] <<SYS>>\n...\n<</SYS>>\n\n`` + the user's text), or
- refused by the template (Mistral Instruct v0.1/v0.2 raise on a system role): the Go template leaves system
  messages out, and the caller warns.

A BOS the template writes once in front, or in front of every user turn (Llama 2), is part of the shape.
Anything else (a default system prompt, a system prompt moved into the last user turn, content trimmed or
rewritten, tools) cannot be written this way: the Modelfile then has no TEMPLATE and the caller warns, and
Ollama uses the GGUF's own chat template metadata where it can.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Render = Callable[[list[dict[str, str]], bool], str]  # (messages, add_generation_prompt) -> text

MARK = {"system": "TFSYS7q", "user": "TFUSR7q", "assistant": "TFAST7q"}
ROLES = ("system", "user", "assistant")
SYSTEM_MODES = ("turn", "merged", "none")  # its own turn; wrapped into the first user turn; refused by the template
MERGED_IF = '{{ if and (eq $i 1) (eq (index $.Messages 0).Role "system") }}'  # a system message right before this turn


@dataclass
class ChatShape:
    """A chat template's per-role wrapping: ``lead + Σ prefix[role] + content + suffix[role] (+ generation)``;
    with ``system == "merged"``, ``prefix/suffix["system"]`` wrap the system text at the start of the first
    user turn's content instead of making a turn of it."""

    lead: str
    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str
    system: str = "turn"

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """What the Go template renders (the check compares it with the Jinja template's rendering)."""
        body = []
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and self.system != "turn":
                continue  # merged into the next turn, or left out
            if role == "user" and self.system == "merged" and i == 1 and messages[0]["role"] == "system":
                content = self.prefix["system"] + messages[0]["content"] + self.suffix["system"] + content
            body.append(self.prefix[role] + content + self.suffix[role])
        return self.lead + "".join(body) + (self.generation if add_generation_prompt else "")

    @property
    def end_of_turn(self) -> str:
        """The text closing an assistant turn (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Llama 2's ``</s>``)."""
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
    one = render([_turn("user")], False)
    leads = [bos_token, ""] if bos_token and one.startswith(bos_token) else [""]  # BOS once in front, or per user turn
    for lead in leads:
        base = _user_and_assistant(render, lead)
        for shape in _with_system(render, base) if base is not None else []:
            if _reproduces(render, shape):
                return shape
    return None


def _user_and_assistant(render: Render, lead: str) -> ChatShape | None:
    u, a = _turn("user"), _turn("assistant")
    one = render([u], False)
    before, after = one[len(lead):].split(u["content"])
    prefix, suffix = {"user": before}, {"user": after}
    prompted = render([u], True)
    if not prompted.startswith(one):
        return None
    between, suffix["assistant"] = render([u, a], False).split(u["content"])[1].split(a["content"])
    if not between.startswith(suffix["user"]):
        return None
    prefix["assistant"] = between[len(suffix["user"]):]
    return ChatShape(lead, prefix, suffix, prompted[len(one):])


def _with_system(render: Render, base: ChatShape) -> list[ChatShape]:
    """The candidate shapes for the system prompt: its own turn or merged into the first user turn (both read
    off a system + user rendering), or none when the template raises on a system message."""
    s, u = _turn("system"), _turn("user")
    try:
        with_system = render([s, u], False)
    except Exception:  # noqa: BLE001 - jinja's raise_exception: the template has no system role
        return [ChatShape(base.lead, base.prefix, base.suffix, base.generation, "none")]
    if not with_system.startswith(base.lead) or with_system.count(s["content"]) != 1:
        return []
    head, rest = with_system[len(base.lead):].split(s["content"])
    gap = rest.split(u["content"])[0]
    shapes = []
    user_prefix = base.prefix["user"]
    if gap.endswith(user_prefix):
        own = {"system": head}, {"system": gap[: len(gap) - len(user_prefix)]}
        shapes.append(ChatShape(base.lead, base.prefix | own[0], base.suffix | own[1], base.generation, "turn"))
    if head.startswith(user_prefix):
        shapes.append(ChatShape(base.lead, base.prefix | {"system": head[len(user_prefix):]}, base.suffix | {"system": gap},
                                base.generation, "merged"))
    return shapes


def _reproduces(render: Render, shape: ChatShape) -> bool:
    u, a, u2, a2 = _turn("user"), _turn("assistant"), _turn("user", 2), _turn("assistant", 2)
    checks = [([u, a, u2], True), ([u, a, u2, a2], False), ([u], True), ([u, a], False)]
    if shape.system != "none":
        s = _turn("system")
        checks += [([s, u, a, u2], True), ([s, u, a], False), ([s, u], True)]
    return all(render(turns, gen) == shape.render(turns, gen) for turns, gen in checks)


def go_template(shape: ChatShape, add_bos: bool, bos_token: str | None = None) -> str | None:
    """The Go template for ``shape`` (None when its text cannot sit in one: Go delimiters, triple quotes).
    A BOS the template writes first is dropped when llama.cpp adds it itself (``add_bos``), as it would appear
    twice: a leading one, or the one opening the first turn when every user turn opens with it (Llama 2)."""
    lead = "" if add_bos else shape.lead
    roles = [r for r in ROLES if r != "system" or shape.system == "turn"]
    pieces = [lead, shape.generation, *shape.prefix.values(), *shape.suffix.values()]
    if any("{{" in p or "}}" in p or '"""' in p for p in pieces):
        return None
    per_turn_bos = bool(add_bos and not shape.lead and bos_token and any(shape.prefix[r].startswith(bos_token) for r in roles))
    branches = []
    for i, role in enumerate(roles):
        prefix = shape.prefix[role]
        if per_turn_bos and prefix.startswith(bos_token):
            prefix = f"{{{{ if not $first }}}}{bos_token}{{{{ end }}}}{prefix[len(bos_token):]}"
        content = "{{ .Content }}"
        if role == "user" and shape.system == "merged":
            content = (f'{MERGED_IF}{shape.prefix["system"]}{{{{ (index $.Messages 0).Content }}}}{shape.suffix["system"]}'
                       f"{{{{ end }}}}{content}")
        done = "{{ $first = false }}" if per_turn_bos else ""
        keyword = "if" if i == 0 else "else if"
        branches.append(f'{{{{ {keyword} eq .Role "{role}" }}}}{prefix}{content}{shape.suffix[role]}{done}')
    first = "{{ $first := true }}" if per_turn_bos else ""
    loop = "{{ range $i, $_ := .Messages }}" if shape.system == "merged" else "{{ range .Messages }}"
    return f"{lead}{first}{loop}{''.join(branches)}{{{{ end }}}}{{{{ end }}}}{shape.generation}"


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
    template = go_template(shape, add_bos, bos_token) if shape is not None else None
    if template is None:
        why = ("the run's chat template is not a role/content shape a Go template can express (a default system "
               "prompt, a system prompt moved into a later turn, rewritten turns, tools): the Modelfile has no "
               "TEMPLATE; write one by hand")
        return modelfile_text(gguf_path, directory, None, []), [why]
    warnings = []
    if shape.system == "none":
        warnings.append("the run's chat template refuses a system message: the Modelfile's TEMPLATE leaves system "
                        "messages out (Ollama's SYSTEM and system turns are not shown to the model)")
    stops = [shape.end_of_turn] if shape.end_of_turn else []
    return modelfile_text(gguf_path, directory, template, stops), warnings
