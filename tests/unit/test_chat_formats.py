"""The instruction layouts TRL and axolotl users bring (aqpipe/data/chat.py), and where the loss falls in each as
TRL's `assistant_only_loss` and `completion_only_loss` put it: ShareGPT rows are the same conversation as
`messages`; a conversational prompt/completion trains on its completion's assistant turns; a row's `tools` reach a
template that renders them; switched off, the loss falls on every token (of the conversation, of the prompt too)."""
import json

import pytest

from aqpipe import data
from aqpipe.data.chat import IGNORE, LossOn, encode_instruction
from tests.helpers.chat import CHATML, CONVERSATION, chat_tokenizer

SHAREGPT = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[t["role"]], "value": t["content"]}
            for t in CONVERSATION]
# a template that takes tools, as Llama 3.1's and Qwen2.5's do: their schemas in a system turn of their own
WITH_TOOLS = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['name'] }} {% endfor %}<|im_end|>\n"
              "{% endif %}" + CHATML)


def targets(tok, row, loss=LossOn()):
    ids, labels = encode_instruction(row, tok, 96, "t", loss)
    assert all(v in (IGNORE, i) for i, v in zip(ids, labels))  # a target is its own token (the model shifts)
    return [tok.convert_ids_to_tokens(v) for v in labels if v != IGNORE], tok.convert_ids_to_tokens(ids)


def test_a_sharegpt_row_is_the_same_conversation_as_its_messages():
    tok = chat_tokenizer(CHATML)
    assert encode_instruction({"conversations": SHAREGPT}, tok, 96, "t") == \
        encode_instruction({"messages": CONVERSATION}, tok, 96, "t")
    got, _ = targets(tok, {"conversations": SHAREGPT})
    assert got == ["hello", "<|im_end|>", "see", "you", "later", "<|im_end|>"]


def test_a_sharegpt_turn_from_an_unknown_speaker_is_one_line():
    bad = [{"from": "bot", "value": "hi"}]
    with pytest.raises(ValueError, match=r"t: turn \{'from': 'bot'.*expected from one of system, human"):
        encode_instruction({"conversations": bad}, chat_tokenizer(CHATML), 96, "t")


def test_assistant_only_loss_off_trains_on_every_token_of_the_conversation():
    tok = chat_tokenizer(CHATML)
    got, ids = targets(tok, {"messages": CONVERSATION}, LossOn(assistant_only=False))
    assert got == ids and "system" in got and "hi" in got


def test_a_conversational_prompt_and_completion_trains_on_the_completions_assistant_turn():
    tok = chat_tokenizer(CHATML)
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    whole = encode_instruction({"messages": CONVERSATION}, tok, 96, "t")[0]
    got, ids = targets(tok, row)
    assert encode_instruction(row, tok, 96, "t")[0] == whole  # rendered as the whole conversation
    assert got == ["see", "you", "later", "<|im_end|>"]  # not the prompt's earlier assistant turn
    got, _ = targets(tok, row, LossOn(completion_only=False))  # the prompt's assistant turns too
    assert got == ["hello", "<|im_end|>", "see", "you", "later", "<|im_end|>"]
    got, _ = targets(tok, row, LossOn(assistant_only=False))  # what the completion renders after the generation
    assert got == ["see", "you", "later", "<|im_end|>"]  # prompt (the prompt's assistant turn is not a target)
    got, _ = targets(tok, row, LossOn(assistant_only=False, completion_only=False))
    assert got == ids


def test_prompt_and_completion_strings_with_completion_only_loss_off_train_on_the_prompt_too():
    tok = chat_tokenizer()
    row = {"prompt": "hi there ", "completion": "hello how can i help"}
    assert targets(tok, row)[0] == ["hello", "how", "can", "i", "help", "</s>"]
    assert targets(tok, row, LossOn(completion_only=False))[0] == ["hi", "there", "hello", "how", "can", "i", "help",
                                                                   "</s>"]


@pytest.mark.parametrize("tools", [[{"name": "help"}], json.dumps([{"name": "help"}])], ids=["list", "json"])
def test_a_rows_tools_reach_a_template_that_renders_them_and_are_not_targets(tools):
    tok = chat_tokenizer(WITH_TOOLS)
    got, ids = targets(tok, {"messages": CONVERSATION[1:3], "tools": tools})
    assert ids[:4] == ["<|im_start|>", "system", "help", "<|im_end|>"] and got == ["hello", "<|im_end|>"]
    assert "help" not in targets(tok, {"messages": CONVERSATION[1:3]})[1]  # none without


def test_tools_that_are_not_function_schemas_are_one_line():
    with pytest.raises(ValueError, match=r"t: tools is not JSON .*expected a list of function schemas"):
        encode_instruction({"messages": CONVERSATION, "tools": "[{"}, chat_tokenizer(WITH_TOOLS), 96, "t")
    with pytest.raises(ValueError, match=r"t: tools=\['help'\]: expected a list of function schemas"):
        encode_instruction({"messages": CONVERSATION, "tools": ["help"]}, chat_tokenizer(WITH_TOOLS), 96, "t")


def test_a_sharegpt_file_and_a_conversational_prompt_completion_file_become_samples(tmp_path):
    tok = chat_tokenizer(CHATML)
    for name, row in (("share.jsonl", {"conversations": SHAREGPT, "id": 1}),
                      ("pc.jsonl", {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]})):
        path = tmp_path / name
        path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
        train = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.5)
        labels = train.tensors["labels"][0]
        assert len(train) == 1 and tok.convert_ids_to_tokens(labels[labels != IGNORE].tolist())[-4:] == [
            "see", "you", "later", "<|im_end|>"]


def test_a_tool_calling_turn_without_content_renders_and_trains_as_the_assistants():
    """TRL's tool-calling layout: an assistant turn of tool_calls and no content (a table fills it with None), the
    tool's answer, then the reply; the call is the assistant's, so a target, and the tool's answer is not."""
    calls = CHATML.replace("{{ m['content'] }}", "{{ m['content'] if m['content'] is defined else "
                                                 "m['tool_calls'][0]['function']['name'] }}")
    turns = [{"role": "user", "content": "hi there"},
             {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                                    "function": {"name": "help", "arguments": {}}}]},
             {"role": "tool", "content": "bye", "tool_calls": None},
             {"role": "assistant", "content": "see you later", "tool_calls": None}]
    got, ids = targets(chat_tokenizer(calls), {"messages": turns, "tools": [{"name": "help"}]})
    assert got == ["help", "<|im_end|>", "see", "you", "later", "<|im_end|>"] and "bye" in ids
    with pytest.raises(ValueError, match=r"expected role one of .* and string content \(or tool_calls\)"):
        encode_instruction({"messages": [{"role": "assistant", "content": None}]}, chat_tokenizer(calls), 96, "t")


def test_a_conversations_column_of_role_and_content_turns_is_the_messages_layout():
    tok = chat_tokenizer(CHATML)
    assert encode_instruction({"conversations": CONVERSATION}, tok, 96, "t") == \
        encode_instruction({"messages": CONVERSATION}, tok, 96, "t")
