"""The family matrix: every decoder-only family of transformers' causal-LM mapping, trained through trainforge.

For each family a tiny random model (``family_shrink.tiny_config``) is saved as a local directory and given as
``model.path``: 3 steps full, then 3 steps LoRA (merged by ``export --merge``), each reloaded in transformers with
the trained model's logits. Packing is what trainforge decides when ``data.packing`` is unset. A family trainforge
refuses must be refused with a ``TrainforgeError`` (exit 2) before any step. The outcome is the table in
``docs/models.md``; ``python -m trainforge.tools.family_matrix [FAMILY...]`` rewrites it (all families when none
is named) and ``tests/unit/test_family_matrix.py`` keeps each row equal to a fresh run.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import TrainforgeError

STEPS = 3
DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"
BEGIN, END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"
HEADER = "| family | full | LoRA | packing | notes |\n|---|---|---|---|---|"
_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def families() -> list[str]:
    """The model types of transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@dataclass(frozen=True)
class Outcome:
    """One row of the table: ``full`` and ``lora`` are ok / refused / skipped / fails; ``packing`` what an unset
    ``data.packing`` resolves to (``-`` where no run config was built)."""

    family: str
    full: str
    lora: str
    packing: str
    note: str = ""

    def row(self) -> str:
        note = self.note.replace("|", "/").replace("\n", " ")
        return f"| {self.family} | {self.full} | {self.lora} | {self.packing} | {note} |"


def _one_line(err: BaseException, limit: int = 160) -> str:
    """An error as one short line: its type and the first line of its message, with run-specific paths cut."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    for sep in ("/tmp/", "/work/"):  # temporary directories differ between runs; the table must not
        while sep in text:
            i = text.index(sep)
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in ",:;)'\"":
                j += 1
            text = text[:i] + "<dir>" + text[j:]
    text = text[:limit] + ("..." if len(text) > limit else "")
    return f"{type(err).__name__}: {text}"


def assets(work: Path) -> tuple[Path, Path]:
    """A tiny byte-level BPE tokenizer directory and a text JSONL of counting runs, built once in ``work``."""
    from ..model.tokenizer import train_bpe_tokenizer

    tok_dir, data = work / "tokenizer", work / "train.jsonl"
    if not (tok_dir / "tokenizer.json").is_file():
        rng = random.Random(0)
        docs = []
        for _ in range(64):
            start, n = rng.randrange(len(_WORDS)), rng.randrange(5, 20)
            docs.append(" ".join(_WORDS[(start + i) % len(_WORDS)] for i in range(n)) + ".")
        train_bpe_tokenizer(docs, vocab_size=300).save_pretrained(tok_dir)
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return tok_dir, data


def _save_tiny(family: str, tok_dir: Path, out: Path) -> None:
    """The family's tiny random model, seeded, saved with the tokenizer as a hub-like directory: the published
    shape, the whole image-text model where the family is one (Mllama, Emu3)."""
    from ..model.load import auto_model_class
    from ..model.tokenizer import load_tokenizer
    from .family_shrink import tiny_config

    tok = load_tokenizer(tok_dir)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = tiny_config(family, len(tok), {k: v for k, v in special.items() if v is not None})
    torch.manual_seed(0)
    cls = _published_class(family, auto_model_class(False, family))
    model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)  # an auto class, or a model's own
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _published_class(family: str, chosen):
    """The class a published checkpoint of ``family`` is saved from: trainforge's ``chosen`` auto class, or, where the
    causal-LM class is one part of the family's composite config (MusicGen's decoder), the whole model's class."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    config = CONFIG_MAPPING[family]
    causal = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], None)
    if getattr(causal, "config_class", config) not in {c for k, c in getattr(config, "sub_configs", {}).items() if k != "text_config"}:
        return chosen
    for names in (auto.MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
        whole = getattr(transformers, names.get(family, ""), None)
        if getattr(whole, "config_class", None) is config:
            return whole
    return chosen


def _config(model_dir: Path, data: Path, method: str) -> dict:
    """A 3-step fp32 CPU run: no eval, no checkpoint before the end, no sample, no report."""
    model: dict = {"path": str(model_dir), "method": method}
    if method == "lora":
        model["lora"] = {"r": 4, "alpha": 8}
    return {
        "model": model,
        "data": {"train": str(data), "eval": None, "max_length": 32, "num_workers": 1},
        "train": {"max_steps": STEPS, "micro_batch_size": 2, "grad_accum": 1, "precision": "fp32", "device": "cpu",
                  "seed": 0, "compile": False,
                  # the memory levers fixed: their "auto" plans the run from a traced skeleton, which here would cost
                  # more than the 3 steps (the levers have their own tests)
                  "activation_checkpointing": False, "tiled_mlp": False, "activation_offload": False},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_steps": None, "every_minutes": None, "keep_last": 1},
        "log": {"every_steps": 1, "report": False, "report_to": []},
    }


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _train_and_reload(model_dir: Path, data: Path, method: str, work: Path, seen: dict[str, str]) -> str:
    """One method through trainforge; "ok" when the reloaded export gives the trained model's logits (``seen`` gets
    the resolved packing as soon as the config validates). Raises what trainforge raised."""
    import yaml

    from ..config.run import load_config
    from ..engine.trainer import train
    from ..model.load import auto_model_class
    from .export import export
    from .selftest.reporters import quiet

    cfg_file = work / f"{method}.yaml"
    cfg_file.write_text(yaml.safe_dump(_config(model_dir, data, method)))
    cfg = load_config(cfg_file)
    seen["packing"] = str(cfg.data.packing).lower()
    out = work / f"run-{method}"
    try:
        run = train(cfg, out, quiet(), resume="never")
    finally:  # as setup settled it (engine/packing_check.py), written before the first step
        if (out / "config.yaml").is_file():
            seen["packing"] = str(yaml.safe_load((out / "config.yaml").read_text())["data"]["packing"]).lower()
    left_out = getattr(run.model, "trainforge_lora_left_out", None)
    if left_out:
        seen["left_out"] = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in left_out}))
    exported = out / "final"  # a full run's final/ is already a plain transformers directory
    if method == "lora":
        exported = work / "export-lora"
        export(out / "final", exported, merge=True, dtype=None, reporter=quiet())
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    trained = _logits(run.model, ids)
    reloaded = _logits(auto_model_class(False, cfg.model.kind.model_type).from_pretrained(exported), ids)
    if not torch.allclose(trained, reloaded, rtol=1e-4, atol=1e-4):
        gap = (trained - reloaded).abs().max().item()
        return f"fails: the export reloads with other logits (max gap {gap:.2e})"
    return "ok"


def run_family(family: str, work: Path) -> Outcome:
    """The family's row: tiny model, full and LoRA runs, export and reload (``work`` is a scratch directory)."""
    from ..hf_dir import model_kind

    tok_dir, data = assets(work.parent / "assets")
    model_dir = work / "model"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _save_tiny(family, tok_dir, model_dir)
    except Exception as e:  # a package or input this machine lacks, or a config the shrinker cannot build
        return Outcome(family, "skipped", "skipped", "-", f"no tiny model built here: {_one_line(e)}")
    kind = model_kind(model_dir)
    results, notes, seen = {}, [], {"packing": "-"}
    for method in ("full", "lora"):
        try:
            results[method] = _train_and_reload(model_dir, data, method, work, seen)
        except TrainforgeError as e:
            results[method] = "refused" if e.exit_code == 2 else f"fails (exit {e.exit_code})"
            notes.append(f"{method}: {_one_line(e)}")
        except Exception as e:  # a traceback inside trainforge or transformers: a bug to fix or to refuse clearly
            results[method] = "fails"
            notes.append(f"{method}: {_one_line(e)}")
        if results[method].startswith("fails:"):
            notes.append(f"{method}: {results[method][7:]}")
            results[method] = "fails"
    if "left_out" in seen:  # layers PEFT would reload elsewhere (model/lora_apply.py)
        notes.append(f"lora: all-linear leaves out {seen['left_out']} (PEFT's load renames their adapters)")
    if kind.recurrent:
        notes.insert(0, f"{kind.recurrent} layers: one example per row")
    elif not kind.encoder_decoder and (kind.fixed_attention or seen["packing"] == "false"):
        # transformers' stock attention, whose mask setup's probe found to keep packed documents apart, or not
        own = "attention of its own" if kind.fixed_attention else "stock attention, whose mask the probe found leaking"
        notes.insert(0, f"{own}: " + ("packs (its document mask checked)" if seen["packing"] == "true" else "one example per row"))
    return Outcome(family, results["full"], results["lora"], seen["packing"], "; ".join(dict.fromkeys(notes)))


def parse_table(text: str) -> dict[str, str]:
    """The family rows of ``docs/models.md``'s table, by family."""
    if BEGIN not in text or END not in text:
        return {}
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [line for line in body.strip().splitlines() if line.startswith("| ") and not line.startswith("| family")]
    return {line.split("|")[1].strip(): line for line in rows}


def write_table(rows: dict[str, str], doc: Path = DOC) -> None:
    """Replace the table between the markers of ``doc`` with ``rows`` (sorted by family)."""
    text = doc.read_text()
    table = "\n".join([HEADER, *(rows[f] for f in sorted(rows))])
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str]) -> None:
    """Run the named families (all when none), update their rows of docs/models.md."""
    import tempfile

    if any(a.startswith("-") for a in argv):  # --help (or any option): this module takes family names only
        print(__doc__)
        return
    unknown = sorted(set(argv) - set(families()))
    if unknown:  # a typo must not become a row of the table
        raise SystemExit(f"family_matrix: not a causal-LM model type of this transformers: {', '.join(unknown)}")
    torch.set_num_threads(1)
    rows = parse_table(DOC.read_text())
    wanted = argv or families()
    rows = {f: r for f, r in rows.items() if f in families()}
    with tempfile.TemporaryDirectory() as tmp:
        for family in wanted:
            outcome = run_family(family, Path(tmp) / family)
            rows[family] = outcome.row()
            print(outcome.row(), flush=True)
    write_table(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
