"""The Gradio chat demo in a real browser: headless Chromium (Debian's chromium-headless-shell, set up by
tests/setup_chromium.sh) driven by Playwright, on the default model. Never skipped: a missing browser fails."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from hf_paged import AsyncPagedEngine, PagedGenerator, SamplingParams
from hf_paged.default_model import load_default
from hf_paged.ui import ChatDemo, build_prompt
from hf_paged.ui.chat import STOPPED

SETUP = Path(__file__).with_name("setup_chromium.sh")
FIRST = "Describe the city of Paris in two sentences."
STORY = "Write a long story about a dragon who learns to bake bread."


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
