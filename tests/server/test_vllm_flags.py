"""vLLM's launch flags on real servers of the default model. One started with a vLLM-style line,
`--chat-template FILE --trust-remote-code --disable-log-requests --max-logprobs 5 --generation-config auto
--response-role bot --disable-log-stats --default-chat-template-kwargs JSON`: the template (a recognisable one, which
also renders tools, documents and its own variables) is what chat requests and /tokenize run on, with or without
tools; a request's chat_template_kwargs override the flag's; top_logprobs 6 is a 400 naming 5; the reply's role is "bot"
(the last message's without a generation prompt); the remote-code note is logged once, and no request nor stats line.
One started with `--enable-log-requests --max-log-len 12 --generation-config FOLDER --stream-interval 3`: each request
is logged with its prompt cut to 12 characters and its sampling params, which take the folder's generation config
where the request leaves them unset; its streamed chunks gather 3 tokens, or a request's larger stream_interval."""

from __future__ import annotations

import ast
import json
import re
import signal
import time

import pytest

from tests.server.server_utils import RemoteServer, read_sse

TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]\n{% endif %}"
    "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
    "{% for d in documents or [] %}[doc: {{ d.title }}]\n{% endfor %}"
    "{% if add_generation_prompt %}<<reply{% if mood %} {{ mood }}{% endif %}"
    "{% if reasoning_effort %} effort={{ reasoning_effort }}{% endif %}"
    "{% if enable_thinking is defined %} think={{ enable_thinking }}{% endif %}>>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
RENDERED = "<<system>> Be brief.\n<<user>> Name a colour.\n<<reply calm>>"  # with --default-chat-template-kwargs
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone"}},
]
STATS_EVERY = {"PAGEDLLM_STATS_LOG_INTERVAL": "0.2"}  # seconds between stats lines while busy
STATS_LINE = "Avg prompt throughput"
GENERATION_CONFIG = {"temperature": 0.25, "top_k": 7, "max_new_tokens": 6, "top_p": 1.0}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_flags")
    (folder / "template.jinja").write_text(TEMPLATE)
    gen = folder / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    vllm_line = RemoteServer(
        *("--chat-template", str(folder / "template.jinja"), "--trust-remote-code", "--disable-log-requests"),
        *("--max-logprobs", "5", "--generation-config", "auto", "--response-role", "bot", "--disable-log-stats"),
        *("--default-chat-template-kwargs", '{"mood": "calm"}'),
        env=STATS_EVERY,
        start=False,
    )
    logging = RemoteServer(
        *("--enable-log-requests", "--max-log-len", "12", "--generation-config", str(gen), "--stream-interval", "3"),
        env=STATS_EVERY,
        start=False,
    )
    try:
        vllm_line.wait_ready()
        logging.wait_ready()
        yield {"vllm_line": vllm_line, "logging": logging}
    finally:
        vllm_line.stop(signal.SIGKILL)
        logging.stop(signal.SIGKILL)


def _chat(srv: RemoteServer, **body) -> tuple[int, dict]:
    return srv.request("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, **body})


@pytest.mark.timeout(600)
def test_chat_template_file_reaches_chat_and_tokenize(servers):
    srv = servers["vllm_line"]
    status, tok = srv.request("POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200, tok
    assert srv.request("POST", "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"] == RENDERED
    status, chat = _chat(srv)
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == tok["count"]


@pytest.mark.timeout(600)
def test_tokenize_renders_tools_as_chat_does(servers):
    srv = servers["vllm_line"]
    without = srv.request("POST", "/tokenize", {"messages": MESSAGES})[1]
    status, with_tools = srv.request("POST", "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    assert status == 200, with_tools
    assert with_tools["count"] > without["count"]
    text = srv.request("POST", "/detokenize", {"tokens": with_tools["tokens"]})[1]["prompt"]
    assert text == "[tools: get_weather get_time]\n" + RENDERED
    status, chat = _chat(srv, tools=TOOLS, tool_choice="none")
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == with_tools["count"]
    # the chat route's checks of the tools' shape, and tools only with messages
    status, body = srv.request("POST", "/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert status == 400 and body["error"]["param"] == "tools[0]", body
    status, body = srv.request("POST", "/tokenize", {"prompt": "hi", "tools": TOOLS})
    assert status == 400 and body["error"]["param"] == "tools", body


def _rendered(srv: RemoteServer, **body) -> tuple[str, int]:
    status, tok = srv.request("POST", "/tokenize", {"messages": MESSAGES, **body})
    assert status == 200, tok
    return srv.request("POST", "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"], tok["count"]


@pytest.mark.timeout(600)
def test_chat_template_kwargs_over_the_servers_default(servers):
    srv = servers["vllm_line"]
    mood = {"mood": "very very very bold"}
    text, count = _rendered(srv, chat_template_kwargs=mood)
    assert text == RENDERED.replace("calm", mood["mood"])
    status, chat = _chat(srv, chat_template_kwargs=mood)
    assert status == 200 and chat["usage"]["prompt_tokens"] == count, chat
    docs = [{"title": "Colours", "text": "Red is a colour."}]
    text, count = _rendered(srv, documents=docs)
    assert text == RENDERED.replace("<<reply", "[doc: Colours]\n<<reply")
    assert _chat(srv, documents=docs)[1]["usage"]["prompt_tokens"] == count
    # reasoning_effort is a template variable too (chat), from `reasoning.effort` on the Responses route
    text, count = _rendered(srv, chat_template_kwargs={"reasoning_effort": "high"})
    assert text == RENDERED.replace("calm", "calm effort=high")
    assert _chat(srv, reasoning_effort="high")[1]["usage"]["prompt_tokens"] == count
    status, resp = srv.request(
        "POST", "/v1/responses", {"input": MESSAGES, "reasoning": {"effort": "high"}, "max_output_tokens": 2}
    )
    assert status == 200 and resp["usage"]["input_tokens"] == count, resp
    # Anthropic's `thinking` is the template's enable_thinking
    text, count = _rendered(srv, chat_template_kwargs={"enable_thinking": False})
    assert text == RENDERED.replace("calm", "calm think=False")
    model = srv.request("GET", "/v1/models")[1]["data"][0]["id"]
    anthropic = {"model": model, "system": "Be brief.", "messages": [{"role": "user", "content": "Name a colour."}]}
    status, plain = srv.request("POST", "/v1/messages/count_tokens", anthropic)
    assert status == 200 and plain["input_tokens"] == _rendered(srv)[1], plain
    status, off = srv.request("POST", "/v1/messages/count_tokens", {**anthropic, "thinking": {"type": "disabled"}})
    assert status == 200 and off["input_tokens"] == count, off
    status, err = srv.request("POST", "/v1/messages/count_tokens", {**anthropic, "thinking": {"type": "maybe"}})
    assert status == 400 and "thinking.type" in err["error"]["message"], err
    # the renderer's own arguments have their own fields
    for route, body in [("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})]:
        bad = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}, **body}
        status, err = srv.request("POST", route, bad)
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err
        assert "'add_generation_prompt'" in err["error"]["message"]


@pytest.mark.timeout(600)
def test_max_logprobs_bounds_top_logprobs(servers):
    srv = servers["vllm_line"]
    status, body = _chat(srv, logprobs=True, top_logprobs=6)
    assert status == 400 and body["error"]["param"] == "top_logprobs", body
    assert "between 0 and 5" in body["error"]["message"]
    status, body = _chat(srv, logprobs=True, top_logprobs=5, max_tokens=1)
    assert status == 200 and len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5
    status, body = srv.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": 6})
    assert status == 400 and "logprobs=6 exceeds the maximum of 5" in body["error"]["message"], body


@pytest.mark.timeout(600)
def test_response_role(servers):
    srv = servers["vllm_line"]
    status, body = _chat(srv)
    assert status == 200 and body["choices"][0]["message"]["role"] == "bot", body
    conn = srv.connect()
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({"messages": MESSAGES, "max_tokens": 2, "stream": True}),
            headers=srv.headers(),
        )
        events = read_sse(conn.getresponse())
    finally:
        conn.close()
    assert events[0]["choices"][0]["delta"]["role"] == "bot"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:-1] if e["choices"])
    # without a generation prompt the reply continues the last message: its role
    status, body = _chat(srv, add_generation_prompt=False)
    assert status == 200 and body["choices"][0]["message"]["role"] == "user", body


@pytest.mark.timeout(600)
def test_startup_notes_and_no_request_log(servers):
    srv = servers["vllm_line"]
    assert _chat(srv)[0] == 200
    log = srv.log_text()
    assert log.count("--trust-remote-code: accepted for vLLM compatibility") == 1, log[-3000:]
    assert "Received request" not in log
    assert "Default sampling parameters" not in log  # no generation_config.json beside the default GGUF


@pytest.mark.timeout(600)
def test_requests_logged_with_the_generation_configs_defaults(servers):
    srv = servers["logging"]
    log = srv.log_text()
    assert "Default sampling parameters have been overridden" in log and "'temperature': 0.25" in log
    status, body = _chat(srv, max_tokens=None, ignore_eos=True)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6  # max_new_tokens: the default max_tokens
    status, body = _chat(srv, temperature=0.9, top_k=3, max_tokens=2)
    assert status == 200 and body["usage"]["completion_tokens"] <= 2, body
    lines = [line for line in srv.log_text().splitlines() if "Received request chatcmpl-" in line]
    assert len(lines) == 2, lines
    unset, given = lines
    assert "temperature=0.25" in unset and "top_k=7" in unset and "max_tokens=6" in unset, unset
    assert "temperature=0.9" in given and "top_k=3" in given and "max_tokens=2" in given, given
    # the prompt and its ids cut to --max-log-len 12
    prompt = re.search(r"prompt: ('.*?'), params:", unset).group(1)
    assert len(ast.literal_eval(prompt)) == 12
    ids = re.search(r"prompt_token_ids: \[([\d, ]*)\]", unset).group(1)
    assert len(ids.split(",")) == 12


@pytest.mark.timeout(600)
def test_disable_log_stats_leaves_out_the_stats_line(servers):
    """--disable-log-stats (vLLM's): no periodic stats line; the other server, busy as long, logs some."""
    for srv in servers.values():
        status, body = _chat(srv, max_tokens=64, ignore_eos=True, temperature=0)
        assert status == 200 and body["usage"]["completion_tokens"] == 64, body
    deadline = time.monotonic() + 10  # the line is written as the steps are recorded; allow for a slow pipe
    while STATS_LINE not in servers["logging"].log_text():
        assert time.monotonic() < deadline, "the server without the flag logged no stats line"
        time.sleep(0.1)
    assert STATS_LINE not in servers["vllm_line"].log_text()


@pytest.mark.timeout(600)
def test_stream_interval_flag_and_a_requests_larger_one(servers):
    """--stream-interval 3: chunks of 3 tokens (the first and the last at once); a request's 2 is raised to the
    server's 3, its 5 is kept."""
    srv = servers["logging"]
    for asked, counts in ((None, [1, 3, 3]), (2, [1, 3, 3]), (5, [1, 5, 1])):
        body = {"prompt": "Once upon a time", "max_tokens": 7, "ignore_eos": True, "logprobs": 1, "stream": True}
        if asked is not None:
            body["stream_interval"] = asked
        conn = srv.connect()
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=srv.headers())
            events = read_sse(conn.getresponse())
        finally:
            conn.close()
        got = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-1] if e["choices"]]
        assert got == counts, (asked, got)
