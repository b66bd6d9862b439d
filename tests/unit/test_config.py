"""Config loading, overrides and error messages (in-process; the CLI exit code is tested in integration)."""

from __future__ import annotations

import pytest
import yaml

from trainforge.config.run import ConfigError, RunConfig, load_config, parse_override, resolve_max_steps


def test_default_config_is_valid_and_resolves_every_key():
    cfg = load_config(None)
    dumped = yaml.safe_load(cfg.to_yaml())
    assert set(dumped) == {"model", "data", "train", "optim", "preference", "rl", "checkpoint", "log", "preset"}  # preset: null unless one applies
    assert dumped["preset"] is None
    assert dumped["model"]["init"]["architecture"] == "llama"
    assert RunConfig.model_validate(dumped) == cfg  # the written config.yaml reloads to the same run


@pytest.mark.parametrize(
    "item, parts, value",
    [
        ("train.max_steps=100", ["train", "max_steps"], 100),
        ("optim.lr=1e-4", ["optim", "lr"], 1e-4),
        ("optim.lr=3.0e-4", ["optim", "lr"], 3e-4),
        ("data.packing=true", ["data", "packing"], True),
        ("data.eval=null", ["data", "eval"], None),
        ("log.sample_prompt=hello world", ["log", "sample_prompt"], "hello world"),
        ("model.lora.target_modules=[q_proj, v_proj]", ["model", "lora", "target_modules"], ["q_proj", "v_proj"]),
    ],
)
def test_parse_override_coerces_types(item, parts, value):
    assert parse_override(item) == (parts, value)


def test_overrides_apply_to_nested_keys():
    cfg = load_config(None, ["train.max_steps=7", "optim.lr=1e-4", "model.init.hidden_size=64"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-4 and cfg.model.init["hidden_size"] == 64


def test_malformed_override():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["train.max_steps"])


def error_of(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("trian.max_steps=3", "trian", "did you mean 'train'"),  # an unknown section: its key was --set too
        ("train.max_stepz=3", "train.max_stepz", "did you mean 'max_steps'"),
        ("train.micro_batch_size=eight", "train.micro_batch_size", "'eight'"),
        ("optim.lr=-1", "optim.lr", "greater than 0"),
        ("data.max_length=0", "data.max_length", "greater than 0"),
        ("data.train=./nope.jsonl", "data.train", "no file matches"),
        ("model.method=qlora", "model.method", "needs a pretrained model.path"),
        ("model.init.hidden_sizee=3", "model.init.hidden_sizee", "did you mean hidden_size"),
        ("model.init.architecture=lama", "model.init.architecture", "did you mean llama"),
        ("train.precision=fp8", "train.precision", "'fp32'"),
        ("data.eval=1.5", "data.eval", "between 0 and 1"),
        ("data.chat_template=chatml", "data.chat_template", "neither a Jinja template"),
    ],
)
def test_bad_values_name_the_key(override, key, fragment):
    msg = error_of([override])
    assert f"  {key}: " in msg and fragment in msg and "(from --set)" in msg


def test_errors_in_yaml_name_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\n"
        "data:\n  train: builtin:python-stdlib\n"
        "train:\n  max_steps: 10\n  max_stepz: 3\n"
        "optim:\n  lr: -0.1\n"
    )
    msg = error_of(path=path)
    assert f"train.max_stepz: unknown key" in msg and f"{path}, line 7" in msg
    assert "optim.lr" in msg and f"{path}, line 9" in msg


def test_a_key_in_the_wrong_section_names_the_section_that_has_it(tmp_path):
    """HF's TrainingArguments hold the learning rate, warmup and clipping beside the steps: ``train.lr`` or
    ``train.warmup_steps`` only said "unknown key" with train's keys (and a wrong guess, if any was close);
    the message names where the key lives."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\n"
        "data:\n  train: builtin:python-stdlib\n"
        "train:\n  lr: 0.001\n  warmup_steps: 10\n  every_steps: 5\n"
        "optim:\n  max_steps: 3\n"
    )
    lines = error_of(path=path).splitlines()[1:]
    assert lines[0].startswith("  train.lr: unknown key; it belongs under optim.lr; allowed here: objective, max_steps,")
    assert lines[0].endswith(f"({path}, line 6)")
    assert lines[1].startswith("  train.warmup_steps: unknown key; it belongs under optim.warmup_steps; allowed here:")
    assert lines[2].startswith("  train.every_steps: unknown key; it belongs under checkpoint.every_steps or log.every_steps;")
    assert lines[3].startswith("  optim.max_steps: unknown key; it belongs under train.max_steps; allowed here: name,")
    assert "unknown key; allowed here: " in error_of(["train.zzz=1"])  # neither close nor elsewhere


def test_hugging_face_training_argument_names_say_the_key_they_are_here(tmp_path):
    """An HF user writes TrainingArguments' names (learning_rate, num_train_epochs, per_device_train_batch_size,
    gradient_accumulation_steps, bf16): they only said "unknown key" with no guess, as no close match exists;
    the message names the key that means the same, in any section or at the top."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\n"
        "data:\n  train: builtin:python-stdlib\n"
        "learning_rate: 0.001\n"
        "train:\n  max_steps: 3\n  num_train_epochs: 1\n  per_device_train_batch_size: 4\n"
        "  gradient_accumulation_steps: 2\n  bf16: true\n"
    )
    msg = error_of(path=path)
    assert "  learning_rate: unknown key; Hugging Face's learning_rate is optim.lr here; allowed here: model," in msg
    assert "train.num_train_epochs: unknown key; Hugging Face's num_train_epochs is train.epochs here;" in msg
    assert "train.per_device_train_batch_size: unknown key; Hugging Face's per_device_train_batch_size is train.micro_batch_size here;" in msg
    assert "train.gradient_accumulation_steps: unknown key; Hugging Face's gradient_accumulation_steps is train.grad_accum here;" in msg
    assert "train.bf16: unknown key; Hugging Face's bf16 is train.precision: bf16 here;" in msg
    assert "it belongs under optim.lr" in error_of(["train.lr=1e-3"])  # a key of another section still says so


def test_a_run_directory_as_model_path_names_its_model(tmp_path, tiny_model_dir):
    """generate, eval and export take a run directory, so users give one as model.path too: it said 'not a Hugging
    Face model directory; it lacks config.json ... download a hub snapshot there', about a directory trainforge wrote."""
    import shutil

    full, lora = tmp_path / "full-run", tmp_path / "lora-run"
    shutil.copytree(tiny_model_dir, full / "final")
    (lora / "final").mkdir(parents=True)
    (lora / "final" / "adapter_config.json").write_text("{}")
    for run in (full, lora):
        (run / "config.yaml").write_text("model: {}\n")
    data = "data.train=builtin:python-stdlib"
    msg = error_of([f"model.path={full}", data])
    assert f"model.path: {full} is a trainforge run directory, not a model directory; its model is {full / 'final'}: " \
           f"set model.path: {full / 'final'}" in msg and "hub snapshot" not in msg
    msg = error_of([f"model.path={lora}", data])
    assert f"its final/ is an adapter: merge it into its base first, `trainforge export {lora} --merge --out DIR`" in msg
    load_config(None, [f"model.path={full / 'final'}", data])  # what it names loads


def test_a_bad_entry_of_a_source_list_is_named_alone_with_its_line(tmp_path):
    """data.train as a list of {path, weight}: the entry's own error, at its line, without the union's other
    members ("data.train: Input should be a valid string", "data.train.0.SourceSpec.weight") nor the
    YAML file named for a value given with --set."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\n"
        "data:\n  train:\n    - builtin:python-stdlib\n    - {path: builtin:python-functions, weight: 0}\n"
    )
    assert error_of(path=path).splitlines()[1:] == [
        f"  data.train.1.weight: Input should be greater than 0; given 0 ({path}, line 6)"
    ]
    msg = error_of([f"data.train=[{{path: builtin:python-stdlib, wieght: 2}}]"], path=path)
    assert msg.splitlines()[1:] == [
        "  data.train.0.wieght: unknown key; did you mean 'weight'? allowed here: path, weight, share, name, format, fields, chat_template (from --set)"
    ]


def test_model_path_must_exist_and_exclude_init(tmp_path):
    assert "model.path" in error_of(["model.path=./does-not-exist"])
    # --set model.path replaces the default's model.init (a layer above it); both given are refused
    assert "exactly one of model.path" in error_of([f"model.path={tmp_path}", "model.init={architecture: llama}"])


def test_lora_needs_a_pretrained_model():
    assert "model.method: lora needs a pretrained model.path" in error_of(["model.method=lora"])


def test_not_yaml_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    assert "top level must be a mapping" in error_of(path=path)


def test_steps_from_epochs():
    cfg = load_config(None, ["train.max_steps=null", "train.epochs=2", "train.grad_accum=4"])
    assert resolve_max_steps(cfg.train, batches_per_epoch=10) == 5
    assert "not both" in error_of(["train.max_steps=5", "train.epochs=2"])


def test_docs_config_reference_is_current():
    """docs/config.md is generated; regenerate with `trainforge config --reference > docs/config.md`."""
    from pathlib import Path

    from trainforge.tools.config_reference import config_reference

    docs = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert docs.read_text() == config_reference()
    # the intro's list of sections once lacked preference and preset: it comes from the schema now
    sections = config_reference().split("Sections: ", 1)[1].split(". ", 1)[0]
    assert sections == ", ".join(f"`{f.alias or n}`" for n, f in RunConfig.model_fields.items())
    assert "`preference`" in sections and "`preset`" in sections


def test_quickstart_example_is_the_builtin_default():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    assert load_config(example) == load_config(None)


@pytest.mark.parametrize("name", ["lora-sft.yaml", "full-sft.yaml"])
def test_examples_validate(name, tmp_path, monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    final = tmp_path / "runs" / "demo" / "final"  # the model `make demo` leaves there
    final.mkdir(parents=True)
    for file in ("config.json", "tokenizer.json"):
        (final / file).write_text("{}")
    (final / "model.safetensors").write_bytes(b"\x02" + b"\0" * 7 + b"{}")  # a safetensors header, no tensors
    monkeypatch.chdir(tmp_path)
    cfg = load_config(root / "examples" / name)
    assert cfg.model.path == Path("runs/demo/final")


def test_a_model_path_that_is_not_a_model_directory_says_what_it_lacks(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = error_of([f"model.path={empty}", "model.init=null"])
    assert "model.path" in message and "config.json, weights (model.safetensors or pytorch_model.bin), tokenizer files" in message
    weights_only = tmp_path / "no-tokenizer"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((tiny_model_dir / name).read_bytes())
    message = error_of([f"model.path={weights_only}", "model.init=null"])
    assert "lacks tokenizer files" in message and "model.tokenizer" in message
    load_config(None, [f"model.path={weights_only}", "model.init=null", f"model.tokenizer={tiny_model_dir}"])


def test_qlora_without_bitsandbytes_names_the_extra(monkeypatch, tiny_model_dir):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    message = error_of([f"model.path={tiny_model_dir}", "model.init=null", "model.method=qlora"])
    assert "model.method: qlora needs bitsandbytes" in message and "pip install 'trainforge[qlora]'" in message


def test_global_batch_size_derives_grad_accum_per_process_count():
    from trainforge.config.run import resolve_grad_accum

    cfg = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4"])
    assert resolve_grad_accum(cfg.train, 1) == 8 and resolve_grad_accum(cfg.train, 2) == 4 and resolve_grad_accum(cfg.train, 8) == 1
    with pytest.raises(ConfigError, match=r"not a multiple of micro_batch_size x processes = 4 x 3 = 12"):
        resolve_grad_accum(cfg.train, 3)
    both = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"train.grad_accum=2 contradicts train.global_batch_size=32"):
        resolve_grad_accum(both.train, 1)
    agreeing = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4", "train.grad_accum=8"])
    assert resolve_grad_accum(agreeing.train, 1) == 8  # a run directory's config.yaml holds both, agreeing
    assert resolve_grad_accum(load_config(None, ["train.grad_accum=3"]).train, 4) == 3  # without it: as given


# ---------------------------------------------------------------- hostile input: limits, finite floats, bounds

import time  # noqa: E402

from trainforge.config import yaml_text as config_yaml  # noqa: E402
from trainforge.config.errors import MAX_ERRORS, SHOWN_CHARS, clip, shown  # noqa: E402
from trainforge.config.yaml_text import InvalidYaml, load_yaml, read_config_text  # noqa: E402


def alias_bomb(levels: int = 10) -> str:
    """Ten anchors, each a list of ten references to the one before: 10^levels values expanded."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once_naming_line_and_key():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"c\.yaml, line \d+: a\d: holds more than 100000 values") as info:
        load_yaml(alias_bomb() + "log: {sample_prompt: *a9}\n", "c.yaml")
    assert time.monotonic() - start < 2 and len(str(info.value)) < 400


def test_aliases_and_merge_keys_of_ordinary_size_still_work():
    text = "base: &b {max_steps: 5, grad_accum: 2}\ntrain:\n  <<: *b\n  grad_accum: 4\nlist: &l [1, 2]\nother: *l\n"
    data, _ = load_yaml(text, "c.yaml")
    assert data["train"] == {"max_steps": 5, "grad_accum": 4} and data["other"] == [1, 2]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("log: {sample_prompt: &r [*r]}\n", "an alias refers to itself"),
        ("log: {sample_prompt: " + "[" * 3000 + "]" * 3000 + "}\n", "nested too deeply"),
        ("x:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(100)) + "  " * 101 + "v\n", "nested too deeply"),
    ],
    ids=["self-reference", "deep-flow", "deep-block"],
)
def test_deep_or_self_referring_documents_are_refused(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_yaml(text, "c.yaml")


def test_a_huge_integer_names_key_and_line():
    with pytest.raises(ConfigError, match=r"c\.yaml, line 2: train\.max_steps: an integer of 120000 characters"):
        load_yaml("train:\n  max_steps: " + "1" * 120_000 + "\n", "c.yaml")


def test_invalid_yaml_is_a_config_error_naming_the_source():
    with pytest.raises(InvalidYaml, match=r'(?s)c\.yaml: not valid YAML.*in "c\.yaml", line 1'):
        load_yaml("model: [a\n", "c.yaml")


def test_a_directory_as_config_is_named_as_one(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; give a YAML config file") as info:
        load_config(tmp_path)
    assert "config.yaml" in str(info.value)
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(ConfigError, match=r"a run directory's config is .*config\.yaml"):
        load_config(tmp_path)


def test_config_files_that_are_no_yaml_text(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        read_config_text(tmp_path / "nope.yaml")
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"model:\n  init: \xff\xfe\x00\x01\n")
    with pytest.raises(ConfigError, match=r"model\.bin, line 2: not UTF-8 text \(byte 0xff"):
        load_config(binary)
    big = tmp_path / "data.jsonl"
    with open(big, "wb") as f:
        f.truncate(config_yaml.MAX_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match="too large for a config"):
        load_config(big)
    with_bom = tmp_path / "bom.yaml"
    with_bom.write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump({"train": {"max_steps": 3}}).encode())
    assert read_config_text(with_bom).startswith("train")


def test_a_device_as_config_is_not_a_regular_file():
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/null")


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("train.max_steps=" + "1" * 120_000, "--set train.max_steps: an integer of 120000 characters"),
        ("log.sample_prompt=" + "[" * 3000, "--set log.sample_prompt: nested too deeply"),
        ("log.sample_prompt=[&r [*r]]", "--set log.sample_prompt: .*refers to itself"),
    ],
    ids=["huge-int", "deep", "self-reference"],
)
def test_override_values_over_a_limit_name_the_key(item, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_override(item)


def test_an_override_that_is_not_yaml_is_its_text_and_validated_as_such():
    assert parse_override("log.sample_prompt=[[x")[1] == "[[x"
    assert "train.max_steps" in error_of(["train.max_steps=[1,"])


def _float_keys() -> list[str]:
    """Every key of the schema whose type admits a float (each section, SourceSpec and LoRA included)."""
    from trainforge.config.run import CheckpointSettings, LogSettings, OptimSettings, TrainSettings
    from trainforge.config.data import DataSettings
    from trainforge.config.model import LoraSettings

    sections = {"data": DataSettings, "train": TrainSettings, "optim": OptimSettings, "checkpoint": CheckpointSettings,
                "log": LogSettings, "model.lora": LoraSettings}
    return [f"{prefix}.{field.alias or name}" for prefix, model in sections.items()
            for name, field in model.model_fields.items() if "float" in str(field.annotation)]


def test_the_schema_has_the_float_keys_this_test_covers():
    assert {"optim.lr", "optim.betas", "train.epochs", "data.eval", "model.lora.alpha", "checkpoint.every_minutes"} <= set(_float_keys())


@pytest.mark.parametrize("key", _float_keys())
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e999"])
def test_every_float_key_refuses_inf_and_nan(key, value):
    given = f"[{value}, 0.9]" if key == "optim.betas" else value
    msg = error_of([f"{key}={given}"])
    assert key in msg and ("finite" in msg or "nan" in msg or "inf" in msg), msg


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.train=[{path: builtin:python-stdlib, weight: .inf}]"], "data.train"),
        (["model.init.rms_norm_eps=.nan"], "model.init.rms_norm_eps"),
        (["model.init.ROPE={factor: .inf, rope_type: linear}"], "model.init.ROPE.factor"),
    ],
)
def test_nested_floats_must_be_finite(overrides, key):
    from trainforge import hf_dir

    # the nested rope settings: rope_parameters in transformers 5, rope_scaling before
    rope = "rope_parameters" if "rope_parameters" in hf_dir.known_config_fields("llama") else "rope_scaling"
    overrides, key = [o.replace("ROPE", rope) for o in overrides], key.replace("ROPE", rope)
    msg = error_of(overrides)
    assert key in msg and "finite" in msg, msg


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.max_steps=" + "1" + "0" * 27, "train.max_steps"),
        ("train.max_steps=1000000001", "train.max_steps"),
        ("train.epochs=1e9", "train.epochs"),
        ("train.micro_batch_size=2097152", "train.micro_batch_size"),
        ("train.grad_accum=2097152", "train.grad_accum"),
        ("train.eval_every=10000000000", "train.eval_every"),
        ("train.seed=-1", "train.seed"),
        ("train.seed=4294967296", "train.seed"),
        ("train.dist_timeout_s=1e12", "train.dist_timeout_s"),
        ("data.max_length=100000000", "data.max_length"),
        ("log.every_steps=10000000000", "log.every_steps"),
        ("log.sample_tokens=100000000", "log.sample_tokens"),
        ("log.profile_steps=[0]", "log.profile_steps"),
        ("checkpoint.every_steps=10000000000", "checkpoint.every_steps"),
        ("optim.warmup_steps=10000000000", "optim.warmup_steps"),
        ("data.train=[{path: builtin:python-stdlib, weight: 1e6}]", "data.train"),
    ],
)
def test_absurd_sizes_are_refused(override, key):
    assert key in error_of([override])


def test_the_largest_allowed_values_pass():
    cfg = load_config(None, ["train.max_steps=1000000000", "train.seed=4294967295", "log.profile_steps=[1, 1000000000]"])
    assert cfg.train.max_steps == 10**9 and cfg.train.seed == 2**32 - 1


def test_messages_quote_at_most_a_bounded_part_of_a_value():
    huge = [[["x" * 10_000] * 1000] * 1000] * 1000  # 10^9 strings if formatted whole
    start = time.monotonic()
    text = shown(huge)
    assert len(text) <= SHOWN_CHARS and time.monotonic() - start < 1
    assert len(clip("y" * 10**6)) <= SHOWN_CHARS
    msg = error_of(["log.sample_prompt=[" + ",".join(["z" * 5000] * 50) + "]", "data.train=" + "q" * 100_000])
    assert "log.sample_prompt" in msg and "data.train" in msg and len(msg) < 2000


def test_a_validation_message_lists_at_most_max_errors_keys():
    msg = error_of([f"train.unknown_{i}=1" for i in range(MAX_ERRORS + 30)])
    assert msg.count("unknown key") == MAX_ERRORS and "... and 30 more" in msg


def test_an_alias_bomb_in_a_config_file_exits_quickly(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb() + yaml.safe_dump({"data": {"train": "builtin:python-stdlib"}}) + "log:\n  sample_prompt: *a9\n")
    start = time.monotonic()
    msg = error_of(path=path)
    assert "bomb.yaml, line" in msg and time.monotonic() - start < 2


def test_a_chat_template_file_is_read_into_the_config(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    (tmp_path / "empty.jinja").write_text("plain words")
    cfg = load_config(None, [f"data.chat_template={tmp_path / 'chat.jinja'}"])
    assert cfg.data.chat_template == template  # config.yaml keeps the text: the run holds what it trained with
    assert "holds no Jinja template" in error_of([f"data.chat_template={tmp_path / 'empty.jinja'}"])


def test_set_on_one_key_of_a_pair_replaces_the_other_below(tmp_path, tiny_model_dir):
    """``--set train.max_steps=N`` on a config with ``epochs`` (what a resume's message asks for, and the way to
    try an epochs config for a few steps) and ``--set model.path=DIR`` on the built-in default (its model.init)
    were refused as "not both"; --set is a layer above the file, as presets are, and replaces the other key."""
    path = tmp_path / "epochs.yaml"
    path.write_text(f"model: {{path: {tiny_model_dir}}}\ndata: {{train: builtin:python-stdlib}}\ntrain: {{epochs: 2}}\n")
    cfg = load_config(path, ["train.max_steps=10"])
    assert (cfg.train.max_steps, cfg.train.epochs) == (10, None)
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    assert cfg.model.path == tiny_model_dir and cfg.model.init is None
    cfg = load_config(path, ["model.init={architecture: llama, hidden_size: 32}"])
    assert cfg.model.path is None and cfg.model.init["hidden_size"] == 32
    # both keys of a pair on the command line, a nested key or a null replace nothing: the clash is named
    assert "give train.max_steps or train.epochs, not both" in error_of(["train.max_steps=10", "train.epochs=1"])
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        load_config(path, ["model.init.architecture=llama"])
    assert load_config(None, ["model.path=null"]).model.init is not None


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` section dropped max_steps of the first, and a run
    of 4 steps became a whole epoch. Refused, naming the key and both lines; merge keys still override."""
    from trainforge.config.run import ConfigError, load_config
    from trainforge.config.yaml_text import load_yaml

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train: builtin:python-stdlib\ntrain:\n  max_steps: 4\ntrain:\n  seed: 3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml, line 5: train: given twice \(first on line 3\); YAML keeps only the last"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"line 3: train\.max_steps: given twice \(first on line 2\)"):
        load_yaml("train:\n  max_steps: 4\n  max_steps: 8\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"--set train: max_steps: given twice; YAML keeps"):
        load_config(None, ["train={max_steps: 2, max_steps: 3}"])
    value, _ = load_yaml("base: &b {lr: 1, wd: 2}\noptim:\n  <<: *b\n  lr: 3\n", "c.yaml")
    assert value["optim"] == {"lr": 3, "wd": 2}


@pytest.mark.parametrize("key", ["train.max_steps=yes", "optim.lr=true", "train.eval_max_batches=off", "data.max_length=on"])
def test_a_boolean_for_a_number_is_refused(key):
    """pydantic took true as 1 for int and float fields, and YAML reads yes/on as true: `max_steps: yes` was one step."""
    from trainforge.config.run import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]}: (true|false) is a boolean \(YAML reads yes/no/on/off"):
        load_config(None, [key])
    assert load_config(None, ["train.compile=true", "data.packing=false"]).train.compile is True  # booleans stay booleans


def test_an_error_of_the_file_is_not_blamed_on_an_unrelated_set(tmp_path):
    """"(from --set)" was added to a section's error whenever any key below it was --set."""
    from trainforge.config.run import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train: builtin:python-stdlib\ntrain:\n  max_steps: 5\n  epochs: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train.seed=3"])
    assert "give train.max_steps or train.epochs, not both" in str(e.value) and "(from --set)" not in str(e.value)
