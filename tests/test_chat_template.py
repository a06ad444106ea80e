"""Chat templates: a template given in place of the model's own, continuing the last
assistant message, template variables, templates that refuse a system message, and clean
errors where a template cannot render a chat."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import tiny_model_dir
from sot import SoT
from sot.cli import main
from sot.errors import ConfigError
from sot.prompts import encode, to_text, use_chat_template

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if not (loop.last and continue_final_message) %}</{{ m['role'] }}>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if think %}(thinking){% endif %}{% endif %}")
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + TEMPLATE)
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tpl") / "model", max_positions=1024)


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    use_chat_template(tok, TEMPLATE)
    return tok


def text_of(tok, item, **kw) -> str:
    return tok.decode(encode(tok, item, chat=True, **kw))


def test_generation_prompt_continuation_and_template_variables(tok) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}
    assert text_of(tok, {"messages": chat["messages"][:1]}) == "<user>hi</user><assistant>"
    assert text_of(tok, chat, generation_prompt=False, continue_final=True) == "<user>hi</user><assistant>Hel"
    assert text_of(tok, chat, generation_prompt=False) == "<user>hi</user><assistant>Hel</assistant>"
    assert text_of(tok, {"messages": chat["messages"][:1]}, template_kwargs={"think": True}).endswith("(thinking)")
    with pytest.raises(ConfigError, match="last message to be the assistant's"):
        encode(tok, {"messages": chat["messages"][:1]}, chat=True, generation_prompt=False, continue_final=True)
    with pytest.raises(ConfigError, match="cannot both be true"):
        encode(tok, chat, chat=True, continue_final=True)
    # chat_template_kwargs set the two flags too, over the arguments, as vLLM applies them
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    assert text_of(tok, chat, template_kwargs=flags) == "<user>hi</user><assistant>Hel"
    assert text_of(tok, chat, template_kwargs={"add_generation_prompt": False}) == text_of(tok, chat,
                                                                                          generation_prompt=False)
    with pytest.raises(ConfigError, match="add_generation_prompt must be true or false"):
        encode(tok, chat, chat=True, template_kwargs={"add_generation_prompt": "no"})


def test_a_template_that_refuses_a_system_message(tok) -> None:
    """Offered tools, a template without a system role gets SoT's tool text at the start of
    the first user message; without tools its refusal is a clean error with the reason."""
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(tok.name_or_path)
    use_chat_template(strict, NO_SYSTEM)
    text = text_of(strict, {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "find x"}], "tools": [TOOL]})
    # (the character tokenizer has no newline: <unk>)
    assert text.startswith("<user>Be brief.<unk><unk>You may call") and text.endswith("find x</user><assistant>")
    with pytest.raises(ConfigError, match="System role not supported"):
        encode(strict, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
               chat=True)


def test_chat_template_flag_and_its_errors(model_dir: Path, tmp_path: Path, capsys) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    base = ["generate", "hi", "--model", str(model_dir), "--max-new-tokens", "3", "--json", "--drafter", "none"]
    assert main([*base, "--chat-template", str(template)]) == 0
    own = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(base) == 0
    assert own != capsys.readouterr().out.strip().splitlines()[-1]  # another prompt, another answer
    sot = SoT.load(str(model_dir), drafter="none", dtype="float32", chat_template=str(template))
    assert sot.tokenizer.decode(sot.encode("hi")) == "<user>hi</user><assistant>"
    assert main([*base, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([*base, "--chat-template", "{% for m in messages %}{{ m.nope() }}{% endfor %}"]) == 2
    assert "cannot render a one-message chat" in capsys.readouterr().err
    # a syntax error is found before any model loads
    assert main(["generate", "hi", "--model", "/no/such/model", "--chat-template", "{% for m in messages %}"]) == 2
    assert "chat template: not valid Jinja" in capsys.readouterr().err


def test_a_conversation_as_raw_text_reads_its_text_parts() -> None:
    """Without a template a conversation is its messages' text, one a line; content given as
    OpenAI's list of text parts is that text (it had been scored as the list's Python repr)."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
                          {"role": "assistant", "content": None, "tool_calls": []},
                          {"role": "user", "content": "again"}]}
    assert to_text(parts) == "Hi!\n\nagain"
    with pytest.raises(ConfigError, match="list of text parts"):
        to_text({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})


def test_a_list_prompt_gets_the_hint_that_fits_it() -> None:
    """A list of messages is told the chat's form; a list of token ids from the library is sent
    to generate_ids; a file's line gets no library hint."""
    from sot.prompts import check_record

    for record, where, hint in (([{"role": "user", "content": "Hi"}], "prompt", 'a chat goes as {"messages"'),
                                ([1, 2], "prompt", "token ids go to SoT.generate_ids"),
                                ([1, 2], "p.jsonl:3", None)):
        with pytest.raises(ConfigError) as refused:
            check_record(record, where)
        text = str(refused.value)
        assert text.startswith(f"{where}: expected a string or a JSON object, got list"), text
        assert (hint in text) if hint else "(" not in text, text
