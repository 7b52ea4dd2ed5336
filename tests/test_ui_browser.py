"""The Gradio chat demo in a real browser: headless Chromium (Debian's chromium-headless-shell, set up by
tests/setup_chromium.sh) driven by Playwright, on the default model. Never skipped: a missing browser fails."""

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from hf_paged import AsyncPagedEngine, PagedGenerator, SamplingParams
from hf_paged.model.default_model import load_default
from hf_paged.outputs import EngineStats
from hf_paged.ui import ChatDemo, build_prompt
from hf_paged.ui.chat import STOPPED
from hf_paged.ui.panel import PoolSnapshot, RequestInfo, render_panel

SETUP = Path(__file__).with_name("setup_chromium.sh")
FIRST = "Describe the city of Paris in two sentences."
STORY = "Write a long story about a dragon who learns to bake bread."
# a count whose noun does not agree with it: "1 requests", "0 request running", "2 block", "3/1 blocks"
WRONG_PLURAL = re.compile(r"(?<![\d.])(?:1 (?:prompt |output )?(?:requests|seqs|blocks|tokens|sequences)"
                          r"|(?:0|[2-9]|[1-9]\d+) (?:prompt |output )?(?:request|seq|block|token|sequence))\b")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.fail(f"playwright is missing ({e}); `make test` installs it (pip install playwright)")
    setup = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1200)
    if setup.returncode != 0:
        pytest.fail(f"no Chromium for the browser test ({SETUP.name} failed):\n{setup.stderr[-4000:]}")
    found = dict(line.split("=", 1) for line in setup.stdout.splitlines() if "=" in line)
    env = dict(os.environ)
    if found.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = found["LD_LIBRARY_PATH"] + ":" + env.get("LD_LIBRARY_PATH", "")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=found["CHROMIUM"], args=["--no-sandbox", "--disable-gpu"],
                                     env=env)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def app():
    model, tok = load_default()
    loop = AsyncPagedEngine(PagedGenerator(model, tok, max_num_seqs=8))
    demo = ChatDemo(loop, temperature=0.0, max_tokens=40)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.launch(port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/", loop, demo, tok
    demo.demo.close()
    loop.shutdown()


def norm(text: str) -> str:
    return " ".join(text.split())


def open_chat(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url, wait_until="domcontentloaded", timeout=120_000)
    page.wait_for_selector("#hfp-message textarea", timeout=120_000)
    return page


def send(page, text: str) -> None:
    page.fill("#hfp-message textarea", text)
    page.press("#hfp-message textarea", "Enter")


def last_answer(page) -> str:
    bots = page.locator("#hfp-chatbot [data-testid=bot]")
    return bots.last.inner_text() if bots.count() else ""


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def set_max_tokens(page, value: int) -> None:
    box = page.locator("#hfp-max-tokens input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    box.blur()


def used_blocks(loop) -> int:
    return loop.call(lambda e: e.kv_manager.num_used_blocks).result(30)


def test_streamed_answer_equals_greedy_and_stop_aborts(browser, app, tmp_path):
    url, loop, demo, tok = app
    conversation = [{"role": "user", "content": FIRST}]
    want = loop.generate(build_prompt(tok, "", conversation), SamplingParams(max_tokens=40, temperature=0)).text
    page = open_chat(browser, url)
    send(page, FIRST)
    seen = set()

    def done():
        text = last_answer(page)
        if text:
            seen.add(text)
        return norm(text) == norm(want) and len(demo.finished) >= 1 and not demo.live

    wait_for(done, 120, f"the streamed answer {want!r}")
    assert norm(last_answer(page)) == norm(want)
    assert any(norm(t) != norm(want) and norm(want).startswith(norm(t)) for t in seen), seen  # it streamed
    assert demo.finished[-1][1] in ("stop", "length")

    # A long answer, stopped mid-way: the request is aborted in the engine and its blocks come back.
    conversation += [{"role": "assistant", "content": want}, {"role": "user", "content": STORY}]
    aborted = loop.num_finished_by_reason["abort"]
    set_max_tokens(page, 400)
    send(page, STORY)
    wait_for(lambda: len(last_answer(page)) > 40 and demo.live, 120, "the story to start streaming")
    page.click("#hfp-stop")
    wait_for(lambda: STOPPED in last_answer(page), 60, "the stopped marker")
    assert demo.finished[-1][1] == "abort"
    assert loop.num_finished_by_reason["abort"] == aborted + 1
    partial = last_answer(page).replace(STOPPED, "")
    assert 0 < len(tok(partial)["input_ids"]) < 400
    check = loop.generate(build_prompt(tok, "", conversation),
                          SamplingParams(max_tokens=len(tok(partial)["input_ids"]) + 8, temperature=0)).text
    assert norm(check).startswith(norm(partial))  # what was shown is the greedy answer's beginning
    assert used_blocks(loop) == 0
    page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
    assert (tmp_path / "chat.png").stat().st_size > 10_000
    print(f"screenshot: {tmp_path / 'chat.png'}")
    page.close()


def test_two_tabs_share_one_batch_and_the_panel_shows_it(browser, app, tmp_path):
    url, loop, demo, tok = app
    pages = [open_chat(browser, url) for _ in range(2)]
    batch = []
    loop.add_observer(lambda info: batch.append(loop.last_batch_size))
    for page, topic in zip(pages, ("a dragon", "a lighthouse keeper")):
        set_max_tokens(page, 300)
        send(page, f"Write a long story about {topic}.")
    panel = pages[0].locator("#hfp-panel")
    wait_for(lambda: "one continuous batch of 2 requests" in panel.inner_text(), 60, "the panel to show the batch")
    assert max(batch) >= 2
    cells = pages[0].locator("#hfp-pool i")
    assert cells.count() == loop.engine.kv_manager.num_blocks  # one cell per block
    assert pages[0].locator("#hfp-pool i.hfp-used, #hfp-pool i.hfp-prefix, #hfp-pool i.hfp-shared").count() > 0
    panel.screenshot(path=str(tmp_path / "panel.png"))
    for page in pages:
        page.click("#hfp-stop")
    for page in pages:
        wait_for(lambda: STOPPED in last_answer(page), 60, "both answers to stop")
    assert used_blocks(loop) == 0
    for page in pages:
        page.close()


def test_engine_errors_show_in_the_chat(browser, app, monkeypatch):
    url, loop, demo, tok = app
    runner = loop.engine.executor.runner
    original = runner.execute
    state = {"fail": True}

    def flaky(out):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("injected failure")
        return original(out)

    monkeypatch.setattr(runner, "execute", flaky)
    page = open_chat(browser, url)
    send(page, "Hello!")
    text = wait_for(lambda: "engine error" in last_answer(page) and last_answer(page), 60, "the error in the chat")
    assert "injected failure" in text
    send(page, "Hello again!")  # the next message is answered normally
    wait_for(lambda: len(page.locator("#hfp-chatbot [data-testid=bot]").all()) == 2 and not demo.live
             and "engine error" not in last_answer(page) and last_answer(page), 120, "a normal answer")
    page.close()


def test_json_schema_box_constrains_the_answer(browser, app):
    """The settings' "JSON schema" box: the answer is JSON valid under it; an invalid schema is a message."""
    import json

    import jsonschema

    url, loop, demo, tok = app
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    page = open_chat(browser, url)
    page.fill("#hfp-json-schema textarea", json.dumps(schema))
    send(page, "Name a city and its country.")
    finished = len(demo.finished)
    wait_for(lambda: len(demo.finished) > finished and not demo.live and last_answer(page), 120, "the JSON answer")
    jsonschema.validate(json.loads(wait_for(lambda: last_answer(page), 10, "the answer")), schema)
    page.fill("#hfp-json-schema textarea", '{"type": "nope"}')
    send(page, "Again.")
    wait_for(lambda: "invalid JSON schema" in last_answer(page), 60, "the schema error in the chat")
    assert used_blocks(loop) == 0
    page.close()


def panel_text(html: str) -> str:
    return norm(re.sub(r"<style>.*?</style>|<[^>]+>", " ", html, flags=re.S))


def test_panel_counts_agree_with_their_nouns():
    def stats(running, blocks, used, queries):
        return EngineStats(num_running=running, num_waiting=0, num_swapped=0, num_kv_blocks=blocks,
                           num_kv_blocks_used=used, num_kv_blocks_cached=0, kv_usage=used / blocks,
                           prefix_cache_queries=queries, prefix_cache_hits=0, num_preemptions={}, num_prompt_tokens=1,
                           num_generated_tokens=1, num_requests_finished=0, num_steps=1)

    one = PoolSnapshot(stats(1, 1, 1, 1), [["r1"]], [False], [1], [RequestInfo("r1", "running", 1, 1, 1)], 1)
    text = panel_text(render_panel(one, 1.0, 1))
    assert "1 seq / 1 request" in text and "1 request running" in text, text
    assert "r1: running, 1 prompt token + 1 output token, 1 block" in text, text
    assert "(1 block of 1 token)" in text and "(1/1 block," in text and "(0/1 token)" in text, text
    assert not WRONG_PLURAL.search(text), WRONG_PLURAL.search(text)
    idle = PoolSnapshot(stats(0, 4, 0, 0), [[]] * 4, [False] * 4, [0] * 4, [], 16)
    text = panel_text(render_panel(idle, 0.0, 0))
    assert "0 seqs / 0 requests" in text and "0 requests running" in text, text
    assert not WRONG_PLURAL.search(text), WRONG_PLURAL.search(text)
    two = PoolSnapshot(stats(2, 4, 2, 2), [["a"], ["b"], [], []], [False] * 4, [1, 1, 0, 0],
                       [RequestInfo("a", "running", 2, 0, 1), RequestInfo("b", "running", 2, 2, 1)], 16)
    text = panel_text(render_panel(two, 0.0, 0))
    assert "2 seqs / 2 requests" in text and "one continuous batch of 2 requests" in text, text
    assert "2 prompt tokens + 0 output tokens, 1 block" in text, text
    assert not WRONG_PLURAL.search(text), WRONG_PLURAL.search(text)


def test_stop_is_enabled_only_while_generating_and_the_panel_marks_the_tabs_own_request(browser, app):
    url, loop, demo, tok = app
    tabs = [open_chat(browser, url) for _ in range(2)]
    stops = [tab.locator("#hfp-stop") for tab in tabs]
    panels = [tab.locator("#hfp-panel") for tab in tabs]
    mine = [tab.locator("#hfp-panel li.hfp-mine") for tab in tabs]

    def agrees(panel):  # the panel's counts agree with their nouns
        text = norm(panel.inner_text())
        assert not WRONG_PLURAL.search(text), (WRONG_PLURAL.search(text), text)
        return text

    assert not demo.live
    for stop, panel in zip(stops, panels):
        assert stop.is_disabled()  # idle: nothing to stop
        wait_for(lambda: "0 requests running" in agrees(panel), 30, "the idle panel")

    # Tab 0 asks: its Stop is enabled, tab 1's is not; its panel marks its own request, tab 1's panel does not.
    # tab 1's answer must outlast the checks made while it runs (400 tokens took ~15 s here: on a fast host it
    # once ended before tab 0's panel was looked at); it is stopped below
    for tab, most in zip(tabs, (400, 4000)):
        set_max_tokens(tab, most)
    send(tabs[0], STORY)
    wait_for(stops[0].is_enabled, 60, "tab 0's Stop to be enabled")
    assert stops[1].is_disabled()
    wait_for(lambda: mine[0].count() == 1, 30, "tab 0's panel to mark its request")
    own = mine[0].inner_text()
    rid0 = demo.live and next(iter(demo.live.values()))[0]
    assert rid0 and rid0 in own and "you" in mine[0].locator(".hfp-you").inner_text()
    assert mine[0].get_attribute("aria-current") == "true"
    wait_for(lambda: rid0 in panels[1].inner_text(), 30, "tab 1's panel to list tab 0's request")
    assert mine[1].count() == 0 and "you" not in panels[1].locator("li").first.inner_text()
    text = wait_for(lambda: "1 request running" in agrees(panels[0]) and agrees(panels[0]), 30, "one request")
    assert "1 seq / 1 request" in text and "1 request running" in agrees(panels[1])

    # Tab 1 asks too: one batch of two, each tab's panel marks its own row (and only it).
    send(tabs[1], "Write a long story about a lighthouse keeper.")
    wait_for(stops[1].is_enabled, 60, "tab 1's Stop to be enabled")
    for panel, row in zip(panels, mine):
        wait_for(lambda: "one continuous batch of 2 requests" in agrees(panel) and row.count() == 1, 60,
                 "both requests in each panel, one of them marked")
    rids = {rid for rs in demo.live.values() for rid in rs}
    assert len(rids) == 2 and rid0 in rids
    rid1 = (rids - {rid0}).pop()
    assert rid0 in mine[0].inner_text() and rid1 not in mine[0].inner_text()
    assert rid1 in mine[1].inner_text() and rid0 not in mine[1].inner_text()
    assert panels[0].locator("li").count() == panels[1].locator("li").count() == 2

    # Stopped: tab 0's Stop goes back to disabled while tab 1's answer (and Stop) goes on.
    stops[0].click()
    wait_for(lambda: STOPPED in last_answer(tabs[0]), 60, "tab 0's answer to stop")
    wait_for(stops[0].is_disabled, 30, "tab 0's Stop to be disabled after stopping")
    assert demo.live and stops[1].is_enabled()
    wait_for(lambda: mine[0].count() == 0 and mine[1].count() == 1 and "1 request running" in agrees(panels[0]),
             30, "tab 0's panel to show only tab 1's request, unmarked")
    stops[1].click()
    wait_for(lambda: STOPPED in last_answer(tabs[1]), 60, "tab 1's answer to stop")
    wait_for(stops[1].is_disabled, 30, "tab 1's Stop to be disabled after stopping")

    # Finished: a short answer runs to its end and Stop is disabled again.
    set_max_tokens(tabs[0], 4)
    send(tabs[0], "Hi!")
    wait_for(lambda: tabs[0].locator("#hfp-chatbot [data-testid=bot]").count() == 2 and not demo.live
             and STOPPED not in last_answer(tabs[0]) and last_answer(tabs[0]), 60, "a short answer")
    assert demo.finished[-1][1] in ("stop", "length")
    wait_for(stops[0].is_disabled, 30, "tab 0's Stop to be disabled after the answer")
    for panel, row in zip(panels, mine):
        wait_for(lambda: "0 requests running" in agrees(panel) and row.count() == 0, 30, "the idle panel again")
    assert used_blocks(loop) == 0
    for tab in tabs:
        tab.close()
