"""``gateway keys ...`` and ``gateway usage``: manage keys and read usage in the configured store.

Where the keys go:
- ``--config`` with ``state.redis_url`` (or ``--redis-url``): the shared store; every replica
  sees the change within a second;
- otherwise the keys file (``--file``, or the config's ``auth.keys_file``): rewritten with PyYAML,
  atomically, 0600; running gateways reload it when it changes;
- neither: ``create`` prints the entry to paste under ``auth: keys:``.

A key is named on the command line by its name, its 8-hex id (``gateway keys list`` shows it) or
its full hash. Exit status: 0 done, 1 not found or refused, 2 bad configuration or arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ..config import ApiKeyConfig, ConfigError, GatewayConfig, load_config
from ..config.core import BUDGET_PERIODS
from .base import UsageRow
from .keys import hash_key, key_from_record, key_to_record, new_key, read_file_records, valid_name, write_file_records

EXIT_FAIL = 1
EXIT_USAGE = 2

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


def parse_time(text: str, *, future: bool) -> float:
    """'30d', '12h' (from now: ahead for --expires, back for --since), an ISO date, or unix seconds."""
    t = text.strip()
    m = _DURATION.match(t)
    if m:
        span = float(m.group(1)) * _UNITS[m.group(2)]
        return time.time() + span if future else time.time() - span
    try:
        return float(t)
    except ValueError:
        pass
    from datetime import datetime, timezone

    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise CliError(f"{text!r} is not a time; use a duration (30d, 12h, 90m), an ISO date (2027-01-31) or unix seconds", EXIT_USAGE) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


# -- the target: a store or a keys file ----------------------------------------------------------------
class Target:
    async def list(self) -> list[ApiKeyConfig]:
        raise NotImplementedError

    async def put(self, key: ApiKeyConfig, *, new: bool) -> None:
        raise NotImplementedError

    def where(self) -> str:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class FileTarget(Target):
    def __init__(self, path: Path):
        self.path = path

    def _records(self) -> list[dict[str, Any]]:
        try:
            return read_file_records(self.path)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise CliError(f"cannot read keys file {self.path}: {exc}", EXIT_USAGE) from None

    async def list(self) -> list[ApiKeyConfig]:
        out = []
        for i, rec in enumerate(self._records()):
            try:
                out.append(key_from_record(rec, f"{self.path}: keys[{i}]"))
            except ConfigError as exc:
                raise CliError("; ".join(exc.problems), EXIT_USAGE) from None
        return out

    async def put(self, key: ApiKeyConfig, *, new: bool) -> None:
        records = self._records()
        record = key_to_record(key)
        for i, rec in enumerate(records):
            if isinstance(rec, dict) and str(rec.get("hash", "")).strip().lower() == key.hash:
                records[i] = record
                break
        else:
            records.append(record)
        write_file_records(self.path, records)

    def where(self) -> str:
        return f"keys file {self.path}"


class StoreTarget(Target):
    def __init__(self, config: GatewayConfig):
        from .redis import RedisStore

        self.store = RedisStore(config)
        self.url = config.state.redis_url or ""

    async def list(self) -> list[ApiKeyConfig]:
        try:
            return await self.store.list_keys()
        except Exception as exc:
            raise CliError(f"cannot reach Redis ({exc.__class__.__name__}); nothing was changed") from None

    async def put(self, key: ApiKeyConfig, *, new: bool) -> None:
        try:
            await self.store.put_key(key)
        except Exception as exc:
            raise CliError(f"cannot reach Redis ({exc.__class__.__name__}); nothing was changed") from None

    def where(self) -> str:
        return "the shared store (Redis)"

    async def close(self) -> None:
        try:
            await self.store.r.aclose()
        except Exception:
            pass


def _config_from(args: argparse.Namespace) -> GatewayConfig | None:
    if getattr(args, "config", None):
        try:
            return load_config(args.config)
        except ConfigError as exc:
            raise CliError(f"{args.config}: " + "; ".join(exc.problems), EXIT_USAGE) from None
    if getattr(args, "redis_url", None):
        from ..config.fields import Problems, Section
        from ..config.state import read_state

        problems = Problems()
        state = read_state(Section({"redis_url": args.redis_url}, "--redis-url", problems))
        if problems:
            raise CliError("; ".join(problems.items), EXIT_USAGE)
        return GatewayConfig(state=state)
    return None


def target_for(args: argparse.Namespace) -> Target | None:
    cfg = _config_from(args)
    if cfg is not None and cfg.state.redis_url:
        return StoreTarget(cfg)
    if getattr(args, "file", None):
        return FileTarget(Path(args.file))
    if cfg is not None and cfg.auth.keys_file:
        return FileTarget(Path(cfg.auth.keys_file))
    if cfg is not None:
        raise CliError(f"{args.config} has neither `state.redis_url` nor `auth.keys_file`: keys written inline in the config are edited by hand", EXIT_USAGE)
    return None


def find(keys: list[ApiKeyConfig], ref: str) -> ApiKeyConfig:
    ref = ref.strip()
    matches = [k for k in keys if ref in (k.name, k.hash, k.hash[7:15])]
    if not matches:
        raise CliError(f"no key named {ref!r} (give its name, its 8-hex id, or its hash)")
    if len(matches) > 1:
        raise CliError(f"{len(matches)} keys are named {ref!r}; give the id instead: " + ", ".join(k.hash[7:15] for k in matches))
    return matches[0]


# -- key fields from flags -----------------------------------------------------------------------------
def _fields_from(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "models", None) is not None:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        out["models"] = tuple(models) if models and models != ["*"] else None
    for flag, field in (("rpm", "rate_limit_rpm"), ("tpm", "rate_limit_tpm"), ("concurrency", "max_concurrent"), ("budget", "budget_tokens")):
        v = getattr(args, flag, None)
        if v is not None:
            out[field] = v if v > 0 else None  # 0 removes the limit
    if getattr(args, "budget_period", None):
        out["budget_period"] = args.budget_period
    if getattr(args, "routes", None) is not None:
        routes = [r.strip() for r in args.routes.split(",") if r.strip()]
        out["routes"] = None if routes in ([], ["default"]) else tuple(routes)  # checked by _validated
    if getattr(args, "priority", None) is not None:
        from ..config.balancer import parse_priority

        priority = parse_priority(int(args.priority) if args.priority.isdigit() else args.priority)
        if isinstance(priority, str):
            raise CliError(f"--priority: {priority}", EXIT_USAGE)
        out["priority"] = priority
    if getattr(args, "admin", None) is not None:
        out["admin"] = args.admin
    if getattr(args, "expires", None):
        out["expires_at"] = None if args.expires in ("never", "none") else round(parse_time(args.expires, future=True), 3)
    if getattr(args, "new_name", None):
        out["name"] = args.new_name
    return out


def _validated(key: ApiKeyConfig) -> ApiKeyConfig:
    """Round-trip through the one validator, so nothing the config would refuse is ever stored."""
    try:
        return key_from_record(key_to_record(key), "key")
    except ConfigError as exc:
        raise CliError("; ".join(exc.problems), EXIT_USAGE) from None


def describe(k: ApiKeyConfig, now: float | None = None) -> dict[str, Any]:
    now = now if now is not None else time.time()
    status = "revoked" if k.disabled else ("expired" if k.expires_at is not None and now >= k.expires_at else "active")
    return {
        "name": k.name,
        "id": k.hash[7:15],
        "status": status,
        "models": list(k.models) if k.models is not None else "*",
        "rpm": k.rate_limit_rpm,
        "tpm": k.rate_limit_tpm,
        "concurrency": k.max_concurrent,
        "budget": f"{k.budget_tokens}/{k.budget_period}" if k.budget_tokens else None,
        "admin": k.admin,
        "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(k.expires_at)) if k.expires_at else None,
    }


# -- commands ----------------------------------------------------------------------------------------
async def _create(args: argparse.Namespace) -> int:
    if not valid_name(args.name):
        raise CliError(f"--name {args.name[:40]!r} is not valid; use 1-64 letters, digits, '.', '_', '-' or '@'", EXIT_USAGE)
    secret = new_key()
    key = ApiKeyConfig(name=args.name, hash=hash_key(secret), created_at=round(time.time(), 3))
    key = _validated(dataclasses.replace(key, **_fields_from(args)))
    target = target_for(args)
    if target is None:
        print(f"New API key {args.name!r}. It is shown once; store it now:\n\n    {secret}\n")
        print("Paste this entry under `auth: keys:` in your config:\n")
        print(yaml.safe_dump([key_to_record(key)], sort_keys=False, default_flow_style=False).rstrip())
        return 0
    try:
        existing = await target.list()
        if any(k.name == key.name and not k.disabled for k in existing):
            raise CliError(f"a key named {key.name!r} already exists in {target.where()}; pick another name or revoke it first")
        await target.put(key, new=True)
    finally:
        await target.close()
    print(f"Created API key {key.name!r} (id {key.hash[7:15]}) in {target.where()}. It is shown once; store it now:\n\n    {secret}\n")
    return 0


async def _with_target(args: argparse.Namespace) -> Target:
    target = target_for(args)
    if target is None:
        raise CliError("say where the keys are: --config FILE (its state.redis_url or auth.keys_file), --redis-url URL or --file KEYS_FILE", EXIT_USAGE)
    return target


async def _list(args: argparse.Namespace) -> int:
    target = await _with_target(args)
    try:
        keys = await target.list()
    finally:
        await target.close()
    rows = [describe(k) for k in sorted(keys, key=lambda k: k.name)]
    if args.json:
        import json

        print(json.dumps(rows, indent=2))
        return 0
    cols = ("name", "id", "status", "models", "rpm", "tpm", "concurrency", "budget", "admin", "expires")
    table = [cols] + [tuple("-" if r[c] is None else (",".join(r[c]) if isinstance(r[c], list) else str(r[c])) for c in cols) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


async def _show(args: argparse.Namespace) -> int:
    target = await _with_target(args)
    try:
        k = find(await target.list(), args.key)
    finally:
        await target.close()
    print(yaml.safe_dump(describe(k), sort_keys=False).rstrip())
    return 0


async def _change(args: argparse.Namespace, **fields: Any) -> int:
    target = await _with_target(args)
    try:
        keys = await target.list()
        k = find(keys, args.key)
        changed = _validated(dataclasses.replace(k, **fields))
        if changed.name != k.name and any(o.name == changed.name and o.hash != k.hash for o in keys):
            raise CliError(f"a key named {changed.name!r} already exists")
        await target.put(changed, new=False)
    finally:
        await target.close()
    what = "revoked" if fields.get("disabled") else "updated"
    print(f"Key {changed.name!r} (id {changed.hash[7:15]}) {what} in {target.where()}.")
    return 0


async def _revoke(args: argparse.Namespace) -> int:
    return await _change(args, disabled=True)


async def _update(args: argparse.Namespace) -> int:
    fields = _fields_from(args)
    if args.enable:
        fields["disabled"] = False
    if not fields:
        raise CliError("nothing to change; give at least one of --models --rpm --tpm --concurrency --budget --admin/--no-admin --expires --routes --priority --rename --enable", EXIT_USAGE)
    return await _change(args, **fields)


async def _usage(args: argparse.Namespace) -> int:
    cfg = _config_from(args)
    if cfg is not None and not cfg.state.redis_url and cfg.admin.enabled:
        return _print_usage(args, *await _usage_from_admin(args, cfg))
    if cfg is None or not cfg.state.redis_url:
        raise CliError(
            "usage is read from the shared store or from a running gateway: give --config with `state.redis_url` "
            "(or --redis-url), or, for the in-memory store, --config with an `admin:` section (the running gateway's admin "
            "listener answers; ADMIN_KEY in the environment)",
            EXIT_USAGE,
        )
    target = StoreTarget(cfg)
    try:
        stored = await target.list()
        keys = stored + [k for k in cfg.auth.keys if k.hash not in {s.hash for s in stored}]  # the config's keys count too
        key_hash = find(keys, args.key).hash if args.key else None
        since = parse_time(args.since, future=False) if args.since else None
        try:
            rows = await target.store.usage(key_hash, since)
        except Exception as exc:
            raise CliError(f"cannot reach Redis ({exc.__class__.__name__})") from None
    finally:
        await target.close()
    return _print_usage(args, rows, {k.hash: k.name for k in keys})


async def _usage_from_admin(args: argparse.Namespace, cfg: GatewayConfig) -> tuple[list[UsageRow], dict[str, str]]:
    """The in-memory store lives in the running gateway: ask its admin listener (GET /admin/usage)."""
    import json
    import os
    import urllib.error
    import urllib.parse
    import urllib.request

    secret = os.environ.get("ADMIN_KEY", "").strip()
    if not secret:
        raise CliError("set ADMIN_KEY in the environment (`gateway admin-key` made it): the in-memory store's usage is read from "
                       "the running gateway's admin listener", EXIT_USAGE)
    query = {}
    if args.key:  # the config's keys, its keys file's included, as the gateway loaded them
        query["key"] = find(list(cfg.auth.keys), args.key).hash
    if args.since:
        query["since"] = repr(parse_time(args.since, future=False))
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(cfg.admin.host, cfg.admin.host)
    url = f"http://{f'[{host}]' if ':' in host else host}:{cfg.admin.port}/admin/usage?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {secret}"})

    def fetch() -> Any:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - our own admin listener, http by design
            return json.loads(resp.read(16 * 1024 * 1024))

    try:
        data = await asyncio.to_thread(fetch)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read(65536))["error"]["message"]
        except Exception:
            message = exc.reason
        raise CliError(f"the admin listener at {url.split('?')[0]} answered {exc.code}: {message}") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot reach the gateway's admin listener at {url.split('?')[0]} ({exc}); is the gateway running?") from None
    try:
        rows = [UsageRow(str(r["key_hash"]), str(r["model"]), int(r["prompt_tokens"]), int(r["completion_tokens"]),
                         int(r["requests"]), int(r["estimated_requests"])) for r in data["usage"]]
        names = {str(r["key_hash"]): str(r["key"]) for r in data["usage"]}
    except (KeyError, TypeError, ValueError):
        raise CliError(f"the admin listener at {url.split('?')[0]} answered something that is not usage") from None
    return rows, names


def _print_usage(args: argparse.Namespace, rows: list[UsageRow], names: dict[str, str]) -> int:
    """The rows of either source (Redis, or a running gateway's admin listener), keys by name."""
    out = [
        {
            "key": names.get(r.key_hash, "?"),
            "id": r.key_hash[7:15],
            "model": r.model,
            "requests": r.requests,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "estimated_requests": r.estimated,
        }
        for r in rows
    ]
    if args.json:
        import json

        print(json.dumps(out, indent=2))
        return 0
    cols = ("key", "id", "model", "requests", "prompt_tokens", "completion_tokens", "estimated_requests")
    table = [cols] + [tuple(str(r[c]) for c in cols) for r in out]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def run(fn: Any, args: argparse.Namespace) -> int:
    try:
        return asyncio.run(fn(args))
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


# -- argument parsing --------------------------------------------------------------------------------
def _where_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="the gateway's config: its state.redis_url, else its auth.keys_file")
    p.add_argument("--redis-url", default=None, help="the shared store, without a config file")
    p.add_argument("--file", default=None, help="a keys file (see auth.keys_file)")


def _limit_flags(p: argparse.ArgumentParser, *, update: bool) -> None:
    p.add_argument("--models", default=None, help="comma-separated models this key may use ('*': every model)")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute" + (" (0 removes the limit)" if update else ""))
    p.add_argument("--tpm", type=int, default=None, help="tokens (prompt + completion) per minute")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at once, over every replica")
    p.add_argument("--budget", type=int, default=None, help="tokens per --budget-period; then 429 insufficient_quota")
    p.add_argument("--budget-period", choices=BUDGET_PERIODS, default=None)
    p.add_argument("--admin", action=argparse.BooleanOptionalAction, default=None, help="may read /metrics")
    p.add_argument("--expires", default=None, help="30d, 12h, an ISO date or unix seconds" + (" ('never' clears it)" if update else ""))
    p.add_argument("--routes", default=None, help="comma-separated forwarded routes this key may use, e.g. "
                   "/v1/chat/completions,/generate ('default': the OpenAI and Anthropic ones)")
    p.add_argument("--priority", default=None, help="the gateway queue's class: interactive, batch or 0-100")


def add_commands(keys: Any, sub: Any) -> None:
    """Add create/list/show/revoke/update under ``gateway keys`` and ``gateway usage`` at the top."""
    p = keys.add_parser("create", help="create a random API key (shown once) in the configured store or keys file")
    p.add_argument("--name", default="default")
    _where_flags(p)
    _limit_flags(p, update=False)
    p.set_defaults(func=lambda a: run(_create, a))

    p = keys.add_parser("list", help="list keys (name, id, status, limits)")
    _where_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_list, a))

    p = keys.add_parser("show", help="one key's details")
    p.add_argument("key", help="name, 8-hex id or hash")
    _where_flags(p)
    p.set_defaults(func=lambda a: run(_show, a))

    p = keys.add_parser("revoke", help="refuse a key from now on (every replica within a second)")
    p.add_argument("key", help="name, 8-hex id or hash")
    _where_flags(p)
    p.set_defaults(func=lambda a: run(_revoke, a))

    p = keys.add_parser("update", help="change a key's models, limits, budget, admin flag or expiry")
    p.add_argument("key", help="name, 8-hex id or hash")
    _where_flags(p)
    _limit_flags(p, update=True)
    p.add_argument("--rename", dest="new_name", default=None)
    p.add_argument("--enable", action="store_true", help="un-revoke")
    p.set_defaults(func=lambda a: run(_update, a))

    p = sub.add_parser("usage", help="tokens and requests per key and model: from Redis, or from a running in-memory gateway's admin listener")
    p.add_argument("--key", default=None, help="name, 8-hex id or hash")
    p.add_argument("--since", default=None, help="24h, 7d, an ISO date or unix seconds (default: everything kept)")
    p.add_argument("--config", "-c", default=None)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_usage, a))
