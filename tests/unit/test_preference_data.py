"""Preference rows in the layouts people have, rendered with real chat templates: only each reply is learned."""

from __future__ import annotations

import numpy as np
import pytest
from test_chat_templates import EXPECT, decode, tokenizer_for

from trainforge.config.data import FieldNames
from trainforge.data.formats import Renderer, detect_format, tokenize_rendered
from trainforge.data.preference import PreferenceRenderer, preference_kind, split_shared_prefix
from trainforge.data.sources import DataError, Row

WHERE = "prefs.jsonl:7"


def learned_text(tok, rendered) -> str:
    chunk = tokenize_rendered([rendered], tok, 4096, "truncate")
    ids, learn = chunk.ids, chunk.learn.astype(bool)
    return decode(tok, ids[learn])


def renderer(family: str = "qwen2.5") -> tuple[object, PreferenceRenderer]:
    tok = tokenizer_for(family)
    return tok, PreferenceRenderer(Renderer("chat", FieldNames(), tok))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_trl_string_pairs_learn_only_the_replies():
    tok, r = renderer()
    chosen, rejected = r.pair(Row({"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome."}, WHERE))
    assert chosen.text == "Capital of France? Paris." and rejected.text == "Capital of France? Rome."
    assert learned_text(tok, chosen).startswith(" Paris.") and "Capital" not in learned_text(tok, chosen)
    assert learned_text(tok, rejected).startswith(" Rome.")


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "gemma2", "phi3"])
def test_trl_conversational_pairs_learn_the_reply_and_its_end_of_turn_marker(family):
    tok, r = renderer(family)
    row = Row({
        "prompt": [user("What is the capital of France?"), assistant("Paris."), user("And of Italy?")],
        "chosen": [assistant("Rome.")],
        "rejected": [assistant("Milan.")],
    }, WHERE)
    chosen, rejected = r.pair(row)
    eot = EXPECT[family]["eot"]
    assert learned_text(tok, chosen) == "Rome." + eot  # the earlier assistant turn is context, not learned
    assert learned_text(tok, rejected) == "Milan." + eot


def test_ultrafeedback_binarized_pairs_take_the_shared_messages_as_the_prompt():
    tok, r = renderer()
    question = "Write a haiku about rain."
    row = Row({
        "prompt": question,  # UltraFeedback-binarized repeats the question beside full conversations
        "chosen": [user(question), assistant("Soft rain on the roof")],
        "rejected": [user(question), assistant("Rain is wet.")],
        "score_chosen": 8.5, "score_rejected": 3.0,
    }, WHERE)
    chosen, rejected = r.pair(row)
    assert question in chosen.text and chosen.text.count(question) == 1
    assert learned_text(tok, chosen) == "Soft rain on the roof<|im_end|>\n"
    assert learned_text(tok, rejected) == "Rain is wet.<|im_end|>\n"


def test_anthropic_hh_implicit_prompt_is_the_shared_prefix_cut_at_a_word():
    chosen = "\n\nHuman: Can you help me bake bread?\n\nAssistant: Sure, start with flour."
    rejected = "\n\nHuman: Can you help me bake bread?\n\nAssistant: Sorry, no."
    prompt, c, r = split_shared_prefix(chosen, rejected)
    assert prompt == "\n\nHuman: Can you help me bake bread?\n\nAssistant:"
    assert (c, r) == (" Sure, start with flour.", " Sorry, no.")
    tok, rend = renderer()
    got_c, got_r = rend.pair(Row({"chosen": chosen, "rejected": rejected}, WHERE))
    assert got_c.text == chosen and got_c.spans == [(len(prompt), len(chosen))]
    assert got_r.spans == [(len(prompt), len(rejected))]


def test_a_prompt_both_sides_already_begin_with_is_written_once():
    """A prompt column beside full texts (HH with its prompt split out, but chosen/rejected left whole) or
    full conversations (UltraFeedback's lists beside a prompt list): the prompt was written twice, its second
    copy learned as part of each reply."""
    tok, r = renderer()
    prompt = "\n\nHuman: Can you help me bake bread?\n\nAssistant:"
    chosen, rejected = r.pair(Row({"prompt": prompt, "chosen": prompt + " Sure, flour.", "rejected": prompt + " No."}, WHERE))
    assert chosen.text == prompt + " Sure, flour." and rejected.text == prompt + " No."
    assert learned_text(tok, chosen).startswith(" Sure, flour.") and "Human" not in learned_text(tok, chosen)
    question = [user("Write a haiku about rain.")]
    row = Row({"prompt": question, "chosen": question + [assistant("Soft rain")], "rejected": question + [assistant("Wet.")]}, WHERE)
    chosen, rejected = r.pair(row)
    assert chosen.text.count("haiku") == 1 and rejected.text.count("haiku") == 1
    assert learned_text(tok, chosen) == "Soft rain<|im_end|>\n" and learned_text(tok, rejected) == "Wet.<|im_end|>\n"
    # TRL's explicit layout, replies only, is read as before
    chosen, _ = r.pair(Row({"prompt": question, "chosen": [assistant("Soft rain")], "rejected": [assistant("Wet.")]}, WHERE))
    assert chosen.text.count("haiku") == 1 and learned_text(tok, chosen) == "Soft rain<|im_end|>\n"


def test_orca_dpo_pairs_read_their_prompt_under_its_data_fields_name():
    """Intel/orca_dpo_pairs: {system, question, chosen, rejected}; data.fields.prompt names the question."""
    tok = tokenizer_for("qwen2.5")
    r = PreferenceRenderer(Renderer("preference", FieldNames(prompt="question"), tok))
    row = Row({"system": "", "question": "Capital of France?", "chosen": " Paris.", "rejected": " Rome."}, WHERE)
    chosen, rejected = r.pair(row)
    assert chosen.text == "Capital of France? Paris." and rejected.text == "Capital of France? Rome."
    assert learned_text(tok, chosen).startswith(" Paris.") and "Capital" not in learned_text(tok, chosen)
    kto = PreferenceRenderer(Renderer("unpaired", FieldNames(prompt="question", completion="answer"), tok))
    rendered, good = kto.unpaired(Row({"question": "2+2?", "answer": " 4", "label": True}, WHERE))
    assert good is True and rendered.text == "2+2? 4" and rendered.spans == [(4, 6)]


def test_stack_exchange_paired_reads_its_replies_under_their_data_fields_names():
    """lvwerra/stack-exchange-paired: {qid, question, date, metadata, response_j, response_k}, response_j the
    preferred answer. data.fields maps all three, the row is detected as a pair, and only the replies are learned."""
    tok = tokenizer_for("qwen2.5")
    names = FieldNames(prompt="question", chosen="response_j", rejected="response_k")
    row = Row({"qid": 1, "question": "How do I reverse a list?", "date": "2010/01/01", "metadata": ["x"],
               "response_j": " Use reversed(xs).", "response_k": " Sort it."}, WHERE)
    assert detect_format(row, names) == "preference" and preference_kind(row, names) == "pairs"
    with pytest.raises(DataError, match="cannot tell the data format"):
        detect_format(row, FieldNames())  # without the names the row is nothing known
    with pytest.raises(DataError, match=r"'response_j'\+'response_k' \(preference\)"):
        detect_format(Row({"question": "q", "answer": "a"}, WHERE), names)  # the hint names the mapped fields
    r = PreferenceRenderer(Renderer("preference", names, tok))
    chosen, rejected = r.pair(row)
    assert chosen.text == "How do I reverse a list? Use reversed(xs)." and rejected.text.endswith(" Sort it.")
    assert learned_text(tok, chosen).startswith(" Use reversed") and "reverse a list" not in learned_text(tok, chosen)
    with pytest.raises(DataError, match="the response_k reply is empty"):
        r.pair(Row({"question": "q?", "response_j": " a", "response_k": " "}, WHERE))


def test_kto_label_under_its_data_fields_name():
    tok = tokenizer_for("qwen2.5")
    names = FieldNames(label="desirable")
    row = Row({"prompt": "2+2?", "completion": " 4", "desirable": True}, WHERE)
    assert detect_format(row, names) == "unpaired" and preference_kind(row, names) == "unpaired"
    rendered, good = PreferenceRenderer(Renderer("unpaired", names, tok)).unpaired(row)
    assert good is True and rendered.text == "2+2? 4"
    with pytest.raises(DataError, match="'desirable' must be true"):
        PreferenceRenderer(Renderer("unpaired", names, tok)).unpaired(Row({"prompt": "a", "completion": " b", "desirable": 1}, WHERE))


@pytest.mark.parametrize(
    "row",
    [
        {"system": "", "question": "Capital of France?", "chosen": "Paris.", "rejected": "Rome."},
        {"chosen": [assistant("Paris.")], "rejected": [assistant("Rome.")]},
    ],
)
def test_a_pair_without_a_prompt_says_to_name_its_field(row):
    """Replies alone, with their prompt under another name (orca_dpo_pairs' 'question'), were trained as
    preferences of replies to nothing; now the row is refused with the field to set."""
    _, r = renderer()
    with pytest.raises(DataError) as e:
        r.pair(Row(row, WHERE))
    assert str(e.value).startswith(f"{WHERE}: no prompt: the row has no 'prompt' field (fields: {sorted(row)})")
    assert "data.fields.prompt" in str(e.value)


def test_kto_rows_in_trl_and_llama_factory_layouts():
    tok, r = renderer()
    assert preference_kind(Row({"prompt": "2+2?", "completion": " 4", "label": True}, WHERE)) == "unpaired"
    rendered, good = r.unpaired(Row({"prompt": "2+2?", "completion": " 4", "label": True}, WHERE))
    assert good is True and rendered.text == "2+2? 4"
    messages = [user("2+2?"), assistant("5"), user("Sure?"), assistant("Yes, 5.")]
    rendered, good = r.unpaired(Row({"messages": messages, "label": False}, WHERE))
    assert good is False and learned_text(tok, rendered) == "Yes, 5.<|im_end|>\n"  # the last assistant turn only


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "q", "chosen": " a", "rejected": " a"}, "identical"),
        ({"prompt": "q", "chosen": " a", "rejected": "  "}, "rejected reply is empty"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("a")]}, "no assistant reply"),
        ({"chosen": "a", "rejected": [assistant("b")]}, "must be both strings, both message lists, or both single messages"),
        ({"prompt": "q", "completion": " a", "label": "yes"}, "'label' must be true"),
        ({"messages": [user("q")], "label": True}, "no assistant turn"),
    ],
)
def test_bad_preference_rows_name_the_file_and_line(row, message):
    _, r = renderer()
    with pytest.raises(DataError) as e:
        r.unpaired(Row(row, WHERE)) if "label" in row else r.pair(Row(row, WHERE))
    assert str(e.value).startswith(WHERE) and message in str(e.value)


def test_pairs_tokenize_as_two_sequences_and_a_pair_that_cannot_fit_is_dropped_whole():
    from trainforge.data.preference import tokenize_pairs

    tok, r = renderer()
    short = r.pair(Row({"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome."}, WHERE))
    long_prompt = r.pair(Row({"prompt": "word " * 200, "chosen": " yes", "rejected": " no"}, WHERE))
    chunk = tokenize_pairs([short, long_prompt, short], tok, max_length=64)
    assert len(chunk.lengths) == 4 and chunk.dropped_masked == 1  # the long prompt leaves no reply in 33 tokens
    assert all(n <= 64 // 2 + 1 for n in chunk.lengths)
    starts = np.concatenate([[0], np.cumsum(chunk.lengths)])
    sides = [decode(tok, chunk.ids[a:b][chunk.learn[a:b].astype(bool)]) for a, b in zip(starts[:-1], starts[1:])]
    assert [s.split("<")[0] for s in sides] == [" Paris.", " Rome.", " Paris.", " Rome."]


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_bad_rows_are_counted_under_skip_and_kto_labels_reach_the_store_and_batches(tmp_path, tiny_tokenizer_dir, objective):
    """Through prepare: with data.on_bad_row skip a bad row is counted (its file and line kept) and the others
    stored as pairs; a KTO store keeps each example's label beside it and its KL sample, and a collated batch
    carries them in the order of its pairs."""
    import json

    from conftest import toy_kto_rows, toy_preference_pairs

    from trainforge.config.run import RunConfig
    from trainforge.data.plan import plan_data
    from trainforge.metrics.console import ConsoleReporter
    from rich.console import Console

    rows = toy_kto_rows(12) if objective == "kto" else toy_preference_pairs(12)
    bad = {"prompt": "q", "completion": " a", "label": "maybe"} if objective == "kto" else {"prompt": "q", "chosen": " a", "rejected": " a"}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:5] + [bad] + rows[5:]))
    cfg = RunConfig.model_validate({
        "model": {"init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 4}, "tokenizer": str(tiny_tokenizer_dir)},
        "data": {"train": str(path), "eval": None, "max_length": 64, "on_bad_row": "skip", "cache_dir": str(tmp_path / "c"),
                 "format": "unpaired" if objective == "kto" else "auto"},
        "train": {"objective": objective},
    })
    from trainforge.model.tokenizer import load_tokenizer

    plan = plan_data(cfg, load_tokenizer(tiny_tokenizer_dir), ConsoleReporter(Console(quiet=True)))
    stats = plan.prepared.stats
    assert stats["bad_rows"] == 1 and stats["bad_row_examples"][0].startswith(f"{path}:6")
    assert stats["train_sequences"] == 2 * 12 and len(plan.prepared.train) == 24
    store = plan.prepared.train
    if objective == "kto":
        assert store.desirable.tolist() == [r["label"] for r in rows for _ in (0, 1)]
        batch = plan.collate(plan.train_rows[:2], [0, 1])
        first = np.concatenate([r[0::2, 0] for r in plan.train_rows[:2]])
        want = [rows[int(np.searchsorted(store.offsets, s, "right") - 1) // 2]["label"] for s in first]
        assert batch.desirable.tolist() == want and batch.n_documents == 2 * len(want)
    else:
        assert store.desirable is None


def test_kto_on_pairs_under_data_format_unpaired_splits_each_pair_into_two_labelled_examples(tmp_path, tiny_tokenizer_dir):
    """KTO on a DPO dataset (TRL's KTOTrainer reads pairs so): with data.format: unpaired each pair is its chosen reply,
    desirable, and its rejected one, undesirable, after the pair's prompt; each with a KL sample. With format auto
    the refusal says so. Before, every pair was a bad row ('label' must be true or false)."""
    import json

    from conftest import toy_preference_pairs
    from rich.console import Console

    from trainforge.config.run import RunConfig
    from trainforge.data.plan import check_objective_data, plan_data
    from trainforge.metrics.console import ConsoleReporter
    from trainforge.model.tokenizer import load_tokenizer

    pairs = toy_preference_pairs(6)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs))

    def config(fmt: str) -> RunConfig:
        return RunConfig.model_validate({
            "model": {"init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 4}, "tokenizer": str(tiny_tokenizer_dir)},
            "data": {"train": str(path), "eval": None, "max_length": 128, "cache_dir": str(tmp_path / "c"), "format": fmt},
            "train": {"objective": "kto"},
        })

    with pytest.raises(DataError, match="or, for KTO on the pairs, data.format: unpaired"):
        check_objective_data(config("auto"))
    tok = load_tokenizer(tiny_tokenizer_dir)
    plan = plan_data(config("unpaired"), tok, ConsoleReporter(Console(quiet=True)))
    store = plan.prepared.train
    assert plan.prepared.stats.get("bad_rows", 0) == 0 and len(store) == 2 * 2 * len(pairs)  # each example with its KL sample
    assert store.desirable.tolist() == [True, True, False, False] * len(pairs)

    def learned(i: int) -> str:  # the reply and its end of text
        a, b = store.offsets[i], store.offsets[i + 1]
        text = tok.decode(store.ids[a:b][store.learn[a:b].astype(bool)])
        assert text.endswith(tok.eos_token)
        return text[: -len(tok.eos_token)]

    def whole(i: int) -> str:
        return tok.decode(store.ids[store.offsets[i] : store.offsets[i + 1]])

    first = pairs[0]
    assert learned(0).strip() == first["chosen"].strip() and learned(2).strip() == first["rejected"].strip()
    assert whole(0).startswith(first["prompt"]) and whole(2).startswith(first["prompt"])
    # the chosen example's KL sample: its prompt with the next pair's chosen reply (another prompt's), not its own rejected one
    assert learned(1).strip() == pairs[1]["chosen"].strip() and whole(1).startswith(first["prompt"])


Q1, Q2, Q3 = "Capital of France?", "Capital of Italy?", "Capital of Spain?"
REPLIES = {Q1: ("Paris.", "Lyon."), Q2: ("Rome.", "Milan."), Q3: ("Madrid.", "Seville.")}


def _pair_layout(layout: str, q: str) -> dict:
    """The pair (q, its chosen and rejected reply) in one of the layouts people have."""
    c, r = REPLIES[q]
    hh = f"\n\nHuman: {q}\n\nAssistant:"
    return {
        "trl": {"prompt": q, "chosen": " " + c, "rejected": " " + r},
        "trl_conversational": {"prompt": [user(q)], "chosen": [assistant(c)], "rejected": [assistant(r)]},
        "hh": {"chosen": f"{hh} {c}", "rejected": f"{hh} {r}"},
        "ultrafeedback": {"chosen": [user(q), assistant(c)], "rejected": [user(q), assistant(r)]},
        "ultrafeedback_prompt": {"prompt": q, "chosen": [user(q), assistant(c)], "rejected": [user(q), assistant(r)],
                                 "score_chosen": 8.0},
        "stack_exchange": {"qid": 1, "question": q, "response_j": " " + c, "response_k": " " + r},
        "orca": {"system": "", "question": q, "chosen": " " + c, "rejected": " " + r},
    }[layout]


LAYOUT_FIELDS = {"stack_exchange": FieldNames(prompt="question", chosen="response_j", rejected="response_k"),
                 "orca": FieldNames(prompt="question")}


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"])
@pytest.mark.parametrize("layout", ["trl", "trl_conversational", "hh", "ultrafeedback", "ultrafeedback_prompt",
                                    "stack_exchange", "orca"])
def test_kto_on_pairs_learns_each_reply_after_one_prompt_and_takes_kl_samples_from_other_prompts(layout, family):
    """Each pair is two examples after the same prompt, each learning its reply (and end of turn) only; a KL sample
    is mismatched: its prompt with another prompt's completion. The chosen example's KL sample took its own pair's
    rejected reply (a matched completion: the same prompt), biasing the reference point towards the rejected replies."""
    from trainforge.data.preference import tokenize_unpaired

    tok = tokenizer_for(family)
    r = PreferenceRenderer(Renderer("unpaired", LAYOUT_FIELDS.get(layout, FieldNames()), tok))
    questions = [Q1, Q2, Q3]
    items = [x for k, q in enumerate(questions) for x in r.examples(Row(_pair_layout(layout, q), f"p.jsonl:{k + 1}"))]
    assert [good for _, good in items] == [True, False] * 3
    chunk = tokenize_unpaired(items, tok, 4096)
    starts = np.concatenate([[0], np.cumsum(chunk.lengths)])
    seqs = [(chunk.ids[a:b], chunk.learn[a:b].astype(bool)) for a, b in zip(starts[:-1], starts[1:])]
    prompt = lambda k: decode(tok, seqs[k][0][: int(np.argmax(seqs[k][1]))])  # noqa: E731
    learned = lambda k: decode(tok, seqs[k][0][seqs[k][1]])  # noqa: E731
    eot = EXPECT[family]["eot"] if layout in ("trl_conversational", "ultrafeedback", "ultrafeedback_prompt") else tok.eos_token
    text = layout in ("trl", "hh", "stack_exchange", "orca")
    reply_of = {(" " if text else "") + reply + eot: q for q in questions for reply in REPLIES[q]}
    for k, q in enumerate(questions):
        example, rejected = 4 * k, 4 * k + 2  # each example is followed by its KL sample
        assert prompt(example) == prompt(rejected) and q in prompt(example) and prompt(example).count(q) == 1
        assert [reply_of.get(learned(example)), reply_of.get(learned(rejected))] == [q, q]
        assert learned(example) != learned(rejected)
        for i in (example, rejected):  # the KL sample: the same prompt, another question's reply
            assert prompt(i + 1) == prompt(i) and reply_of.get(learned(i + 1)) not in (None, q)


def test_a_pair_with_a_label_under_data_format_unpaired_says_what_it_is():
    """A pair that also holds a 'label' was read as a labelled completion: "'prompt' and 'completion' must both be
    strings or both be message lists", about a field the row never had."""
    _, r = renderer()
    with pytest.raises(DataError) as e:
        r.examples(Row({"prompt": "q", "chosen": " a", "rejected": " b", "label": True}, WHERE))
    assert str(e.value).startswith(f"{WHERE}: a pair ('chosen', 'rejected') with a 'label'") and "data.fields.label" in str(e.value)
    # a labelled completion with other columns named chosen and rejected is still the labelled completion
    (rendered, good), = r.examples(Row({"prompt": "q", "completion": " a", "label": False, "chosen": 1, "rejected": 0}, WHERE))
    assert rendered.text == "q a" and good is False


def test_a_kl_sample_takes_the_completion_of_the_next_example_with_another_prompt():
    from trainforge.data.preference import kl_partners

    assert kl_partners(["a", "b", "c"]) == [1, 2, 0]  # labelled rows of distinct prompts: the next one, as before
    assert kl_partners(["a", "a", "b", "b"]) == [2, 2, 0, 0]  # split pairs: the next pair's
    assert kl_partners(["a", "b", "a", "a"]) == [1, 2, 1, 1]  # around the end, past a first run of the same prompt
    assert kl_partners(["a", "a"]) == [1, 0] and kl_partners(["a"]) == [0]  # one prompt only: nothing else to take


def test_the_data_line_counts_cut_sides_and_dropped_pairs_in_their_units():
    """A pair too long for its row is cut on both sides (two sequences) and, with nothing left to learn, dropped
    whole (one pair): the line said '32 truncated, 16 dropped' of 180 rows, as if 48 rows were touched."""
    from types import SimpleNamespace

    from trainforge.data.plan import describe_data

    stats = {"format": "preference", "train_rows": 180, "train_sequences": 328, "train_tokens": 3232, "eval_rows": 20,
             "truncated": 32, "dropped_masked": 16}
    plan = SimpleNamespace(prepared=SimpleNamespace(stats=stats), collate=SimpleNamespace(packed=True, concat=False),
                           train_rows=[0] * 26)
    assert describe_data(plan, 0.97).endswith("eval 20 rows; 32 sides truncated, 16 pairs dropped with nothing to learn")
    stats["format"] = "prompt_completion"
    assert describe_data(plan, 0.97).endswith("eval 20 rows; 32 truncated, 16 dropped with nothing to learn")
    # KTO on pairs: 285 pairs are 570 examples, of which 556 dropped; the line read '285 train rows -> 28 sequences ...
    # 556 examples dropped', more examples dropped than rows
    stats.update(format="unpaired", train_rows=285, train_sequences=28, truncated=1140, dropped_masked=556)
    line = describe_data(plan, 0.97)
    assert "285 train rows (570 examples) -> 28 sequences" in line and line.endswith("556 examples dropped with nothing to learn")
    stats.update(train_rows=14 + 556)  # labelled rows: one example each, said once
    assert "570 train rows -> 28 sequences" in describe_data(plan, 0.97)


def test_hh_string_pairs_split_after_the_last_assistant_marker():
    """Replies that begin alike (" I think ... 4." / " I think ... 5.") are learned whole: the prompt ends at the
    last "Assistant:" the two texts share, not at their last shared word (ORPO's NLL, SimPO's and IPO's per-token
    means and KTO's examples would see only the differing tail)."""
    head = "\n\nHuman: What is 2+2?\n\nAssistant: Let me see.\n\nHuman: Well?\n\nAssistant:"
    prompt, c, r = split_shared_prefix(head + " I think the answer is 4.", head + " I think the answer is 5.")
    assert prompt == head and (c, r) == (" I think the answer is 4.", " I think the answer is 5.")
    tok, rend = renderer()
    chosen, _ = rend.pair(Row({"chosen": head + " I think it is 4.", "rejected": head + " I think it is 5."}, WHERE))
    assert learned_text(tok, chosen).startswith(" I think it is 4.")
    # no marker: the shared prefix cut at a word, as before
    assert split_shared_prefix("Q: 2+2? A: it is 4", "Q: 2+2? A: it is 5") == ("Q: 2+2? A: it is", " 4", " 5")
    with pytest.raises(DataError, match="identical"):  # not "the chosen reply is empty"
        rend.pair(Row({"chosen": head + " 4.", "rejected": head + " 4."}, WHERE))
    with pytest.raises(DataError, match="identical"):
        rend.pair(Row({"chosen": "Q: 4", "rejected": "Q: 4"}, WHERE))


def test_a_prompt_string_before_reply_only_lists_is_the_question():
    """{"prompt": "...", "chosen": [assistant], "rejected": [assistant]}: the question was dropped (the pair
    rendered as a bare assistant turn); it is a user turn before each reply."""
    tok, r = renderer()
    row = Row({"prompt": "What is 3+3?", "chosen": [assistant("6.")], "rejected": [assistant("7.")]}, WHERE)
    chosen, rejected = r.pair(row)
    assert "What is 3+3?" in chosen.text and "What is 3+3?" in rejected.text
    assert learned_text(tok, chosen) == "6.<|im_end|>\n" and learned_text(tok, rejected) == "7.<|im_end|>\n"
    with pytest.raises(DataError, match="no prompt"):
        r.pair(Row({"prompt": " ", "chosen": [assistant("6.")], "rejected": [assistant("7.")]}, WHERE))
