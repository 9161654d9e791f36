"""The routes that act for every tenant (tenancy.ADMIN_PATHS): weights from disk, sleep mode and
the prefix-cache reset. Only a key with the admin role may call them (a tenant key gets 403);
a server without keys serves them only with --enable-admin-routes (vLLM keeps them behind its
dev mode). ``/update_weights_from_disk`` loads only folders under --allowed-weights-path, and
its errors never echo what a path holds (docs/reliability.md, "Admin routes")."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request

from pagellm.entrypoints.openai.serving_errors import OpenAIError, bad_request
from pagellm.entrypoints.openai.tenancy import ADMIN, ROLE_SCOPE_KEY
from pagellm.errors import WeightUpdateError

if TYPE_CHECKING:
    from pagellm.engine.async_llm import AsyncLLM

logger = logging.getLogger("pagellm")


@dataclass(frozen=True)
class AdminOptions:
    enable_admin_routes: bool = False  # --enable-admin-routes: without keys, open to all
    allowed_weights_path: str | None = None  # --allowed-weights-path


def check_admin(role: str | None, keys_configured: bool, options: AdminOptions) -> None:
    """403 unless a caller whose key has ``role`` (None: no key) may run an admin route."""
    if role == ADMIN or (not keys_configured and options.enable_admin_routes):
        return
    if keys_configured:
        raise OpenAIError(403, "This route acts for every tenant and needs a key with the "
                          "admin role (--admin-api-key, or 'KEY [NAME] role=admin' in "
                          "--api-key-file); the key sent has the tenant role.",
                          code="admin_key_required")
    raise OpenAIError(403, "The admin routes are off on a server without API keys: start "
                      "it with --admin-api-key KEY (or, on a machine only you can reach, "
                      "--enable-admin-routes).", code="admin_routes_disabled")


def resolve_weights_path(root: str | None, given: str) -> str:
    """The real path of ``given`` (absolute, or relative to ``root``) when it lies under
    ``root`` (symlinks resolved on both sides); else a 400 that says nothing of what exists."""
    if root is None:
        raise bad_request("Loading weights from disk is off: start the server with "
                          "--allowed-weights-path DIR (checkpoint folders under DIR may be "
                          "loaded).", "model_path")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, os.path.expanduser(given)))
    if os.path.commonpath([real_root, real]) != real_root:
        raise bad_request("model_path must be a folder under the server's "
                          "--allowed-weights-path.", "model_path")
    return real


def add_admin_routes(app: FastAPI, engine: AsyncLLM, options: AdminOptions,
                     keys_configured: bool, enable_sleep_mode: bool) -> None:
    """The admin routes; the sleep routes only with ``enable_sleep_mode``."""

    def admin_only(raw_request: Request) -> None:
        check_admin(raw_request.scope.get(ROLE_SCOPE_KEY), keys_configured, options)

    guarded = [Depends(admin_only)]

    @app.post("/reset_prefix_cache", dependencies=guarded)
    async def reset_prefix_cache() -> dict:
        return {"success": await engine.reset_prefix_cache()}

    @app.post("/update_weights_from_disk", dependencies=guarded)
    async def update_weights_from_disk(raw_request: Request) -> dict:
        # SGLang's route: requests running now finish first; those sent meanwhile wait.
        try:
            body = await raw_request.json()
        except ValueError:
            body = None
        given = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(given, str) or not given:
            raise bad_request("model_path (a string: a safetensors checkpoint folder) is "
                              "required.", "model_path")
        path = resolve_weights_path(options.allowed_weights_path, given)
        try:
            n = await engine.update_weights_from_disk(path)
        except ValueError as e:  # nothing changed; the message names no server detail...
            # ...nor where a symlink under the root leads: the client's own spelling.
            raise bad_request(str(e).replace(repr(path), repr(given)), "model_path") from e
        except WeightUpdateError as e:
            # Weights changed and then the load failed: restored, or out of service (AsyncLLM
            # then counts the engine dead: the server stops, for the orchestrator to restart).
            logger.error("update_weights_from_disk(%r) failed: %s", path, e)
            raise OpenAIError(500 if e.restored else 503, str(e),
                              code="weights_restored" if e.restored
                              else "engine_out_of_service") from e
        return {"success": True, "message": f"Loaded {n} tensors from {given}.",
                "num_tensors": n}

    if enable_sleep_mode:
        _add_sleep_routes(app, engine, guarded)


def _add_sleep_routes(app: FastAPI, engine: AsyncLLM, guarded: list) -> None:
    """vLLM's sleep-mode routes (--enable-sleep-mode only). A sleep waits for the running
    requests to finish; from the moment it arrives until /wake_up returns, generation requests
    get a 503 (code "engine_sleeping")."""

    @app.post("/sleep", dependencies=guarded)
    async def sleep(level: int = 1) -> dict:
        if level not in (1, 2):
            raise bad_request(f"level must be 1 (free the KV cache) or 2 (and the weights), "
                              f"got {level}.", "level")
        await engine.sleep(level)
        return {"success": True, "level": level}

    @app.post("/wake_up", dependencies=guarded)
    async def wake_up() -> dict:
        await engine.wake_up()
        return {"success": True}

    @app.get("/is_sleeping", dependencies=guarded)
    async def is_sleeping() -> dict:
        return {"is_sleeping": await engine.is_sleeping()}
