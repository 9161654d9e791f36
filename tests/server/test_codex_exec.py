"""OpenAI's Codex CLI (``codex exec``, which speaks only the Responses API) for one turn
against a real ``pagellm serve`` of the default model. Skipped unless a ``codex`` binary is
installed (``npm install -g @openai/codex``; ``CODEX_BIN`` names one off the PATH) and node
runs it: the test never installs anything.

Codex's own prompt (base instructions, permission and environment notes, skills, a dozen
tools) is 6-10k tokens, more than a test's context; its config shortens it: base instructions
from a file, no environment or permission notes, no skills, no sub-agent, goal, shell or web
search tools. Its requests still carry what Codex always sends: ``include`` of
``reasoning.encrypted_content``, ``prompt_cache_key``, ``client_metadata``, ``store`` false,
developer messages, streaming. What is checked is the protocol (the request reached
/v1/responses and was answered, exit code 0, the answer printed), not the model's wisdom."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from server_utils import ServerProcess, bearer

pytestmark = pytest.mark.slow

MODEL = "smol"
API_KEY = "sk-codex-test-0123456789"
CONFIG = """\
model = "{model}"
model_provider = "pagellm"
model_instructions_file = "{instructions}"
model_reasoning_summary = "none"
model_context_window = 2048
include_permissions_instructions = false
include_environment_context = false
web_search = "disabled"
[agents]
enabled = false
[features]
goals = false
shell_tool = false
image_generation = false
apps = false
plugins = false
skill_search = false
tool_suggest = false
sleep_tool = false
[skills]
include_instructions = false
[model_providers.pagellm]
name = "pagellm"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "PAGELLM_TEST_API_KEY"
"""


def codex_binary() -> str | None:
    path = os.environ.get("CODEX_BIN") or shutil.which("codex")
    if path is None or shutil.which("node") is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if version.returncode == 0 else None


@pytest.fixture(scope="module")
def codex():
    path = codex_binary()
    if path is None:
        pytest.skip("no codex binary (npm install -g @openai/codex, or CODEX_BIN) or no node")
    return path


@pytest.fixture(scope="module")
def server(codex, tmp_path_factory):
    root = tmp_path_factory.mktemp("codex-server")
    # Codex sends no temperature (nor max_output_tokens): greedy by the server's default, so
    # that the small model's answer ends (sampled at 1.0 it can ramble to the context's end).
    (root / "generation_config.json").write_text('{"temperature": 0.0}')
    log = root / "server.log"
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "512MiB",
                         "--generation-config", str(root),
                         "--max-model-len", "2048", "--served-model-name", MODEL,
                         "--api-key", API_KEY, "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--chat-template", "chatml_tools"],
                        log)
    srv.headers = bearer(API_KEY)
    yield srv
    srv.stop()


def test_codex_exec_one_turn(codex, server, tmp_path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer in one short sentence.\n")
    (home / "config.toml").write_text(CONFIG.format(
        model=MODEL, instructions=instructions, base_url=server.base_url))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), PAGELLM_TEST_API_KEY=API_KEY, NO_COLOR="1")
    run = subprocess.run([codex, "exec", "--skip-git-repo-check", "-C", str(work),
                          "Say hi to the user."], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, env=env, timeout=600)
    log = server.log()
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{log[-3000:]}"
    assert '"POST /v1/responses HTTP/1.1" 200' in log, log[-3000:]
    assert "400 Bad Request" not in log, log[-3000:]
    assert run.stdout.strip(), run.stderr  # the final message: codex exec's stdout
    assert "ERROR" not in run.stderr, run.stderr
