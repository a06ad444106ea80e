"""Pieces of the server that need no process: streamed text with stop strings, and the
worker's metrics bookkeeping."""
from __future__ import annotations

import pytest

from sot.server.metrics import ServerMetrics
from sot.server.protocol import APIError, TextAssembler, validation_message


class _CharTokenizer:
    """Token i is chr(i); 0xFFFD stands for half of a multi-token character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_streamed_deltas_join_to_the_text_cut_at_the_stop_string() -> None:
    text = TextAssembler(_CharTokenizer(), ("END",))
    deltas = [text.add(_ids(piece), final=False) for piece in ("hello E", "N", "x wor", "ld E", "ND more")]
    assert deltas == ["hello ", "", "ENx wor", "ld ", ""], "a possible stop prefix is held back, then released"
    assert "".join(deltas) == "hello ENx world "
    assert text.add([], final=True) == "" and text.final_text() == "hello ENx world "


def test_min_tokens_counts_only_stop_strings_that_end_after_them() -> None:
    """As the engine checks stop strings from the token after the first ``min_tokens`` (vLLM's
    rule), the text is cut only where a stop string ends after their text; a mark (a tool
    call's opening) cuts from the first token."""
    for pieces in (("aXb", "cXdXe"), ("a", "X", "bc", "X", "dXe"), ("aXbcXdXe",)):
        text = TextAssembler(_CharTokenizer(), ("X",), min_tokens=4)  # "aXbc": its X does not count
        deltas = [text.add(_ids(p), final=False) for p in pieces]
        assert "".join(deltas) == "aXbc" and text.final_text() == "aXbc", pieces
    # one that begins in them and ends after them counts
    text = TextAssembler(_CharTokenizer(), ("cXd",), min_tokens=4)
    assert text.add(_ids("aXbcXde"), final=True) == "aXb"
    # text of the first min_tokens holds no stop string that counts, so it streams as it comes
    text = TextAssembler(_CharTokenizer(), ("X",), min_tokens=3)
    assert text.add(_ids("aX"), final=False) == "aX" and text.add(_ids("bX"), final=True) == "b"
    text = TextAssembler(_CharTokenizer(), ("X",), min_tokens=5, marks=("<c>",))
    assert text.add(_ids("aX<c>bX"), final=True) == "aX"


def test_an_incomplete_character_waits_for_its_last_token() -> None:
    text = TextAssembler(_CharTokenizer(), ())
    assert text.add(_ids("ab") + [0xFFFD], final=False) == "ab"
    assert text.add([0xFFFD], final=False) == ""
    assert text.add(_ids("c"), final=True) == "\ufffd\ufffdc"


def test_validation_messages_name_the_parameter() -> None:
    msg, param = validation_message([{"loc": ("body", "temperature"), "msg": "must be <= 2", "type": "x"}])
    assert param == "temperature" and msg == "temperature: must be <= 2"
    assert validation_message([{"loc": (), "msg": "bad", "type": "json_invalid"}])[0] == "the request body is not valid JSON"
    # the member of a union pydantic tried is no field of the client's
    assert validation_message([{"loc": ("body", "stop", "str"), "msg": "bad", "type": "x"}])[1] == "stop"
    assert validation_message([{"loc": ("body", "prompt", "list[int]", 0), "msg": "bad", "type": "x"}])[1] == "prompt.0"


def test_step_metrics_count_drafts_and_accepted_positions() -> None:
    m = ServerMetrics()
    m.step(drafted=(5, 0, 3), accepted_per_pos=(2, 1, 0))
    text = m.render().decode()
    assert "sot:spec_decode_num_drafts_total 2.0" in text
    assert "sot:spec_decode_num_draft_tokens_total 8.0" in text
    assert "sot:spec_decode_num_accepted_tokens_total 3.0" in text
    assert 'sot:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2.0' in text
    assert 'sot:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text


def test_the_response_store_keeps_the_most_recently_used() -> None:
    from sot.server.responses import ResponsesRequest, ResponseStore

    store = ResponseStore(capacity=2)
    ask = ResponsesRequest(model="m", input="hi")

    def answer(rid: str, text: str) -> dict:
        return {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}

    store.put(answer("r1", "one"), ask)
    store.put(answer("r2", "two"), ResponsesRequest(model="m", input="more", previous_response_id="r1"))
    assert store.history("r2") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
                                   {"role": "user", "content": "more"}, {"role": "assistant", "content": "two"}]
    store.get("r1")  # used last: r2 goes first
    store.put(answer("r3", "three"), ask)
    assert len(store) == 2 and store.get("r1")["id"] == "r1"
    with pytest.raises(APIError) as err:
        store.get("r2")
    assert err.value.status == 404
    items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    store.put(answer("r4", "four"), ResponsesRequest(model="m", input=items))
    first = store.input_items("r4", limit=2)
    assert [i["content"][0]["text"] for i in first["data"]] == ["m4", "m3"] and first["has_more"]
    rest = store.input_items("r4", limit=10, after=first["last_id"])
    assert [i["content"][0]["text"] for i in rest["data"]] == ["m2", "m1", "m0"] and not rest["has_more"]


def test_logprob_bytes_join_to_the_answer_across_split_characters() -> None:
    """OpenAI's ``bytes`` per token: where a character is split across tokens (each decodes
    alone to a replacement character), the tokens' bytes still join to the answer's UTF-8,
    for byte-level BPE (the default model's tokenizer) and byte-fallback pieces."""
    from transformers import AutoTokenizer

    from sot.models.loading import resolve_model_path
    from sot.sampling import TokenLogprob
    from sot.server.protocol import LogprobWriter

    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    text = "日本語のテキスト 😀🎉 naïve"
    ids = tok.encode(text, add_special_tokens=False)
    writer = LogprobWriter(tok, chat=True)
    writer.add([TokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids])
    content = writer.upto(len(text))["content"]
    assert sum(e["token"] == "\ufffd" for e in content) >= 4, "the text must split characters across tokens"
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8") == text
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
    for end in ("猫", "ok 😀"):  # an answer that ends in a split character reports its last token too
        ids = tok.encode(end, add_special_tokens=False)
        writer = LogprobWriter(tok, chat=True)
        writer.add([TokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids])
        content = writer.upto(len(end))["content"]
        assert len(content) == len(ids) and b"".join(bytes(e["bytes"]) for e in content).decode("utf-8") == end

    class ByteFallback:  # SentencePiece-style pieces: "<0xE6>" tokens spell a character's bytes
        pieces = ["<0xE6>", "<0x97>", "<0xA5>", "▁a"]

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            raw = b"".join(bytes([int(self.pieces[i][3:5], 16)]) if self.pieces[i].startswith("<0x")
                           else self.pieces[i].replace("▁", " ").encode() for i in ids)
            return raw.decode("utf-8", errors="replace")

        def convert_ids_to_tokens(self, token: int) -> str:
            return self.pieces[token]

    writer = LogprobWriter(ByteFallback(), chat=True)
    writer.add([TokenLogprob(t, -1.0, []) for t in range(4)])
    content = writer.upto(10)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8") == "日 a"


def test_a_conversation_stays_whole_while_its_latest_turn_is_kept() -> None:
    """Past the store's capacity the least recently used response goes, but its turn moves
    into the response continuing it: a long conversation in a small store can still be
    continued from its latest turn, which (just used) is the last to go. Only a deleted turn
    breaks its chain."""
    from sot.server.responses import ResponsesRequest, ResponseStore

    store = ResponseStore(capacity=3)
    previous = None
    for i in range(1, 7):
        if previous is not None:
            store.history(previous)  # (as a continuation reads it)
        output = [{"type": "message", "content": [{"type": "output_text", "text": f"a{i}"}]}]
        store.put({"id": f"r{i}", "output": output},
                  ResponsesRequest(model="m", input=f"q{i}", previous_response_id=previous))
        previous = f"r{i}"
    assert len(store) == 3 and store.get("r6")
    with pytest.raises(APIError):
        store.get("r1")  # the oldest turns went first
    assert [m["content"] for m in store.history("r6")] == [x for i in range(1, 7) for x in (f"q{i}", f"a{i}")]
    store.delete("r5")
    with pytest.raises(APIError, match="continues 'r5', which was deleted") as err:
        store.history("r6")
    assert err.value.status == 404


def test_responses_that_the_server_stopped_fail_and_items_close_in_order() -> None:
    """A chat answer the server aborted (shutdown) is a failed response, not kept; an error in
    the stream ends it with ``response.failed``; a streamed message is done before a
    function call after it opens, as OpenAI streams one item at a time."""
    from sot.server.responses import ResponseBuilder, ResponsesRequest

    def chat(finish: str) -> dict:
        return {"choices": [{"message": {"content": "par"}, "finish_reason": finish}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"))
    builder.stored = True
    done = builder.whole(chat("abort"))
    assert done["status"] == "failed" and done["error"]["code"] == "server_error" and not done["store"]
    assert not builder.stored and done["output"][0]["status"] == "incomplete"
    assert ResponseBuilder(ResponsesRequest(model="m", input="hi")).whole(chat("length"))["status"] == "incomplete"

    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"))
    events = builder.opening()
    events += builder.on_chunk({"choices": [{"delta": {"content": "Let me look."}}]})
    events += builder.on_chunk({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]})
    events += builder.on_chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    events += builder.closing(None)
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))
    assert kinds[-1] == ("response.completed", None)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["completed"] * 2

    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"))
    builder.on_chunk({"choices": [{"delta": {"content": "half"}}]})
    last = builder.closing(None, error="the engine failed")
    assert last[-1]["type"] == "response.failed" and last[-1]["response"]["error"]["message"] == "the engine failed"
    assert last[-2]["item"]["status"] == "incomplete"


def test_responses_input_and_metadata_are_checked_as_openai_does() -> None:
    from sot.server.responses import ResponsesRequest

    def refused(**fields) -> str:
        with pytest.raises(APIError) as err:
            ResponsesRequest(model="m", **fields).chat_body()
        assert err.value.status == 400
        return err.value.param

    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    for bad in ({**call, "call_id": None}, {**call, "arguments": {"a": 1}},
                {k: v for k, v in call.items() if k != "name"},
                {"type": "function_call_output", "output": "x"}, {"type": "function_call_output", "call_id": "c"}):
        assert refused(input=[{"role": "user", "content": "hi"}, bad]) == "input"
    assert refused(input="hi", metadata={"k": 1}) == "metadata"
    assert refused(input="hi", metadata={f"k{i}": "v" for i in range(17)}) == "metadata"
    assert refused(input="hi", truncation="auto") == "truncation"
    # other APIs' token limits and several answers are refused by name, not ignored
    for name, value in (("max_tokens", 2), ("max_completion_tokens", 2), ("max_new_tokens", 2), ("n", 3)):
        assert refused(input="hi", **{name: value}) == name
    ResponsesRequest(model="m", input="hi", n=1).chat_body()  # (asks for nothing more)
    ok = ResponsesRequest(model="m", input=[{"role": "user", "content": "hi"}, call,
                                            {"type": "function_call_output", "call_id": "c", "output": "3"}],
                          metadata={f"k{i}": "v" for i in range(16)}, truncation="disabled").chat_body()
    assert [m["role"] for m in ok["messages"]] == ["user", "assistant", "tool"]
    # a wrong type inside the body names its field
    assert validation_message([{"loc": ("body", "metadata"), "msg": "x", "type": "dict_type"}]) == \
        ("metadata: must be a JSON object", "metadata")


def test_a_streamed_auto_answer_sends_a_bare_json_call_once() -> None:
    """With ``tool_choice`` auto, a call written as bare JSON (Llama 3's form) is held back and
    sent as a call alone, as the whole answer reads it (not as content too); an answer that
    is not a call streams as content, and both join to the whole answer's message."""
    from sot.server.protocol import ToolAnswer
    from sot.tools import ToolUse

    use = ToolUse.of([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}])
    for answer in ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', " [not a call]", "Sunny today."):
        tool = ToolAnswer(_CharTokenizer(), (), use)
        deltas = [tool.delta(_ids(answer[i:i + 5]), "", final=i + 5 >= len(answer)) for i in range(0, len(answer), 5)]
        last = tool.last_delta(answer) or {}
        content = "".join(d["content"] for d in [*deltas, last] if d and "content" in d)
        whole = tool.message(answer)
        assert (content or None) == whole["content"], answer
        assert [c["function"]["name"] for c in last.get("tool_calls", [])] == \
            [c["function"]["name"] for c in whole.get("tool_calls", [])]
        if answer.startswith("Sunny"):
            assert deltas[0] == {"content": "Sunny"}  # (streams as it comes)


def test_streamed_auto_content_keeps_special_tokens_when_asked() -> None:
    """``skip_special_tokens: false``: the content streamed with tools offered is the text the
    whole answer has, special tokens' text included, not that text without them and again."""
    from sot.server.protocol import ToolAnswer
    from sot.tools import ToolUse

    class WithSpecial(_CharTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return "".join("" if i == 1 and skip_special_tokens else "<s>" if i == 1 else chr(i) for i in ids)

    use = ToolUse.of([{"type": "function", "function": {"name": "f"}}])
    tool = ToolAnswer(WithSpecial(), (), use, skip_special=False)
    ids = _ids("ab") + [1] + _ids("cd") + [1]
    text = WithSpecial().decode(ids, skip_special_tokens=False)
    streamed = [tool.delta(ids[:3], "", final=False), tool.delta(ids[3:], "", final=True), tool.last_delta(text)]
    assert "".join(d["content"] for d in streamed if d and "content" in d) == text == "ab<s>cd<s>"


def test_vllm_structured_outputs_and_fields_this_server_would_ignore() -> None:
    """vLLM's ``structured_outputs`` asks for a form as the ``guided_*`` fields do (one form a
    request); fields whose meaning this server does not give are refused by name, not
    ignored."""
    from sot.server.protocol import ChatCompletionRequest, CompletionRequest
    from sot.structured import OutputFormat, StructuredOutput

    def chat(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     **fields})

    assert chat(structured_outputs={"regex": "[0-9]{3}"}).structured_output() == \
        ("structured_outputs", StructuredOutput(OutputFormat.REGEX, "[0-9]{3}"))
    assert chat(structured_outputs={"choice": ["a", "b"]}).structured_output() == \
        ("structured_outputs", StructuredOutput.choice(["a", "b"]))
    assert chat(structured_outputs={"json_object": True}).structured_output()[1] == StructuredOutput(OutputFormat.JSON)
    assert chat(guided_regex="x+").structured_output()[0] == "guided_regex"
    for fields, param in (({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                          ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs"),
                          ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
                          ({"structured_outputs": {"choice": []}}, "structured_outputs"),
                          ({"guided_choice": []}, "guided_choice")):
        with pytest.raises(APIError) as err:
            chat(**fields).structured_output()
        assert err.value.status == 400 and err.value.param == param, fields
    for request, field in ((chat(allowed_token_ids=[1]), "allowed_token_ids"), (chat(echo=True), "echo"),
                           (chat(bad_words=["x"]), "bad_words"),
                           (CompletionRequest.model_validate({"model": "m", "prompt": "a", "max_completion_tokens": 2}),
                            "max_completion_tokens"),
                           (CompletionRequest.model_validate({"model": "m", "prompt": "a", "prompt_logprobs": 1}),
                            "prompt_logprobs"),
                           # another API's name for the token limit: ignored, the answer would fill the context
                           (chat(max_output_tokens=2), "max_output_tokens"),
                           (chat(max_new_tokens=2), "max_new_tokens"),
                           # output other than text: refused, not answered with text alone
                           (chat(modalities=["text", "audio"]), "modalities"),
                           (chat(audio={"voice": "alloy", "format": "wav"}), "audio")):
        with pytest.raises(APIError) as err:
            request.check_supported()
        assert err.value.param == field
    chat(modalities=["text"], prediction={"type": "content", "content": "x"}).check_supported()  # (text: fine)


def test_the_caches_sizes_are_read_when_scraped() -> None:
    m = ServerMetrics()
    held = {"tokens": 10.0}
    m.watch(prefix_bytes=lambda: 2048.0, suffix_tokens=lambda: held["tokens"], suffix_stores=lambda: 3.0,
            responses=lambda: 4.0)
    held["tokens"] = 25.0
    text = m.render().decode()
    for line in ("sot:prefix_cache_bytes 2048.0", "sot:suffix_store_tokens 25.0", "sot:suffix_stores 3.0",
                 "sot:responses_kept 4.0"):
        assert line in text


def test_a_turn_whose_parent_went_meanwhile_keeps_the_conversation() -> None:
    """A response that continues one evicted while it ran keeps the conversation it read, so
    it can still be continued."""
    from sot.server.responses import ResponsesRequest, ResponseStore

    def answer(rid: str) -> dict:
        return {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": rid}]}]}

    store = ResponseStore(capacity=2)
    store.put(answer("A"), ResponsesRequest(model="m", input="qa"))
    read = store.history("A")  # B starts, reading A's conversation
    store.put(answer("C"), ResponsesRequest(model="m", input="qc"))
    store.put(answer("D"), ResponsesRequest(model="m", input="qd"))  # A goes meanwhile
    store.put(answer("B"), ResponsesRequest(model="m", input="qb", previous_response_id="A"), read)
    assert [m["content"] for m in store.history("B")] == ["qa", "A", "qb", "B"]


def test_an_echoed_prompts_offsets_follow_its_text() -> None:
    """``text_offset`` of an echoed prompt counts characters of the prompt's text: a character
    spelled by two byte tokens (each alone a replacement character) advances it once."""
    from sot.server.protocol import prompt_logprobs_block

    class ByteTokenizer:  # tokens 1 and 2 together spell "é"; alone each is half of it
        def decode(self, ids, skip_special_tokens=True):
            out, i = [], 0
            while i < len(ids):
                if ids[i] == 1 and i + 1 < len(ids) and ids[i + 1] == 2:
                    out.append("é")
                    i += 2
                    continue
                out.append("\ufffd" if ids[i] in (1, 2) else chr(ids[i]))
                i += 1
            return "".join(out)

    block = prompt_logprobs_block(ByteTokenizer(), [97, 1, 2, 98], [None] * 4)
    assert block["text_offset"] == [0, 1, 1, 2]  # "a", then "é" from 1, then "b" at 2 of "aéb"
    assert block["tokens"] == ["a", "\ufffd", "\ufffd", "b"]


def test_no_user_and_an_empty_one_are_one_tenant() -> None:
    """``user`` keys tenants by a digest; a request without one and one with ``""`` share,
    as the suffix stores count them."""
    from sot.server.app import tenant_key

    assert tenant_key(None) is None and tenant_key("") is None
    assert tenant_key("alice") == tenant_key("alice") != tenant_key("bob") and len(tenant_key("x" * 10**6)) == 32


def test_a_text_part_without_text_is_named_as_such() -> None:
    """A content part of type text with no text is a 400 saying so (not that text parts are
    unsupported); another type is refused by its type; text parts join."""
    from sot.server.protocol import ChatMessage

    joined = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]})
    assert joined.text() == "ab"
    for part, needle in (({"type": "text"}, "content part 1 of type 'text' has no text"),
                         ({"type": "text", "text": None}, "content part 1 of type 'text' has no text"),
                         ({"type": "image_url", "image_url": {"url": "x"}}, "type 'image_url' are not supported")):
        msg = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"}, part]})
        with pytest.raises(APIError) as err:
            msg.text()
        assert err.value.status == 400 and needle in str(err.value), str(err.value)


def test_only_an_assistant_message_may_come_without_content() -> None:
    """OpenAI's rule: a user, system or tool message needs content (an empty string is some);
    an assistant's that made tool calls may have none. The 400 names the message."""
    from pydantic import ValidationError

    from sot.server.protocol import ChatMessage

    assert ChatMessage.model_validate({"role": "user", "content": ""}).text() == ""
    assert ChatMessage.model_validate({"role": "assistant", "tool_calls": []}).text() == ""
    for role in ("user", "system", "tool"):
        with pytest.raises(ValidationError) as refused:
            ChatMessage.model_validate({"role": role, "content": None})
        errors = [{**e, "loc": ("body", "messages", 2, *e["loc"])} for e in refused.value.errors()]
        assert validation_message(errors) == (f"messages.2: a {role} message needs content", "messages.2")


def test_a_seed_is_a_64_bit_integer() -> None:
    from pydantic import ValidationError

    from sot.server.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for seed in (-(2**63), 0, 2**63 - 1):
        assert ChatCompletionRequest.model_validate({**body, "seed": seed}).seed == seed
    for seed in (2**63, -(2**63) - 1, 2**70):
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate({**body, "seed": seed})
        message, param = validation_message(refused.value.errors())
        assert param == "seed" and message.startswith("seed: Input should be"), message
