"""The grammar compile worker's child process: compiles each spec it is sent and says whether it compiled.

Run as a script (``python compile_child.py TOKENIZER_INFO_JSON_PATH``), never imported by the engine: it imports
only xgrammar and the standard library, so a stuck compile can be ended by killing the process (xgrammar's
compile cannot be interrupted inside a thread). Protocol, one JSON object per line: it writes
``{"ready": true}`` once its compiler is built; then for each job line ``{"method", "source"}`` it writes
``{"ok": true, "seconds": s}`` or ``{"ok": false, "error": message}``. It exits when its stdin closes.
"""

import json
import sys
import time


def _compile(compiler, method: str, source: str) -> None:
    if method == "json_schema":
        compiler.compile_json_schema(source, any_whitespace=False)
    elif method == "regex":
        compiler.compile_regex(source)
    elif method == "grammar":
        compiler.compile_grammar(source)
    else:
        raise ValueError(f"unknown compile method {method!r}")


def main() -> None:
    channel = sys.stdout
    sys.stdout = sys.stderr  # whatever a library prints must not break the protocol
    import xgrammar

    with open(sys.argv[1], encoding="utf-8") as f:
        info = xgrammar.TokenizerInfo.deserialize_json(f.read())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def reply(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    reply({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        try:
            _compile(compiler, job["method"], job["source"])
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a bad spec
            reply({"ok": False, "error": str(e)})
        else:
            reply({"ok": True, "seconds": time.perf_counter() - start})


if __name__ == "__main__":
    main()
