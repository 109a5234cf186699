"""The `switchyard` command line as a user runs it (real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
from sqlmodel import select

from switchyard.policy import compile_policy
from switchyard.store import db
from switchyard.store.models import AdminUser
from tests.integration.conftest import SWITCHYARD
from tests.unit.policy.base import base, to_yaml

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SWITCHYARD, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_policy_validate_accepts_the_demo_policy() -> None:
    result = run("policy", "validate", str(ROOT / "policies.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    tests = len(compile_policy((ROOT / "policies.yaml").read_text()).document.tests)
    assert f"valid (2 regions, 7 pools, 4 models, 1 routes, 3 tiers; {tests} policy tests passed)" in result.stdout


def test_policy_validate_prints_one_line_per_error(tmp_path: Path) -> None:
    doc = base()
    doc["pools"][0]["region"] = "us-esat"
    doc["tiers"][0]["priority"] = "nope"
    doc["models"][1]["fallback"] = ["nowhere"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(to_yaml(doc))
    result = run("policy", "validate", str(bad))
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3, result.stdout
    assert lines[0].startswith("pools[small-us].region: unknown region 'us-esat'; did you mean 'us-east'? (")
    assert all(f"({bad}:" in line for line in lines)
    as_json = json.loads(run("policy", "validate", "--json", str(bad)).stdout)
    assert as_json["valid"] is False and len(as_json["errors"]) == 3
    assert {"path", "message", "line", "source"} == set(as_json["errors"][0])


def test_policy_validate_missing_file(tmp_path: Path) -> None:
    result = run("policy", "validate", str(tmp_path / "nope.yaml"))
    assert result.returncode == 1
    assert "cannot read policy file" in result.stdout


def test_policy_schema_is_json_schema_that_checks_the_demo(tmp_path: Path) -> None:
    result = run("policy", "schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    from ruamel.yaml import YAML

    demo = YAML(typ="safe").load((ROOT / "policies.yaml").read_text())
    jsonschema.validate(demo, schema)
    demo["pools"][0]["kv_cache_tokens"] = "lots"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(demo, schema)


def test_keys_for_many_tenants_in_one_run(tmp_path: Path, database_url: str) -> None:
    env = {"SWITCHYARD_DATABASE_URL": database_url, "SWITCHYARD_POLICY_FILE": str(ROOT / "policies.yaml")}
    assert run("db", "upgrade", env=env).returncode == 0
    assert run("keys", "create", "--tenant", "old-co", "--tier", "pro", env=env).returncode == 0
    lines = "# tenant tier\nco-1 free\n\nco-2 pro\nold-co pro\n"
    made = subprocess.run([SWITCHYARD, "keys", "create-many", "--name", "onboarding"], input=lines,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert made.returncode == 0, made.stderr
    secrets = json.loads(made.stdout)
    assert sorted(secrets) == ["co-1", "co-2", "old-co"] and all(v.startswith("sk-sy-") for v in secrets.values())
    keys = json.loads(run("keys", "list", "--json", env=env).stdout)
    assert sorted((k["tenant"], k["tier"]) for k in keys if k["name"] == "onboarding") == [
        ("co-1", "free"), ("co-2", "pro"), ("old-co", "pro")]
    for bad, why in [("co-3 gold\n", "unknown tier 'gold'"), ("co-4\n", "line 1: give TENANT TIER"),
                     ("co-5 free\nco-1 pro\n", "tenant 'co-1' is in tier 'free', not 'pro'")]:
        refused = subprocess.run([SWITCHYARD, "keys", "create-many"], input=bad, capture_output=True, text=True,
                                 timeout=60, env={**os.environ, **env})
        assert refused.returncode == 1 and why in refused.stderr, refused.stderr
    # Nothing of a refused run was written.
    names = {t["name"] for t in json.loads(run("tenants", "list", "--json", env=env).stdout)}
    assert names == {"old-co", "co-1", "co-2"}


def test_db_upgrade_and_key_lifecycle(tmp_path: Path, database_url: str) -> None:
    env = {"SWITCHYARD_DATABASE_URL": database_url, "SWITCHYARD_POLICY_FILE": str(ROOT / "policies.yaml")}
    assert "behind head" in run("db", "current", env=env).stdout
    first = run("keys", "list", env=env)
    assert first.returncode == 1 and "run `switchyard db upgrade` first" in first.stderr
    assert run("db", "upgrade", env=env).returncode == 0
    assert f"{db.head_revision()} (current)" in run("db", "current", env=env).stdout

    unknown = run("keys", "create", "--tenant", "acme", "--tier", "gold", env=env)
    assert unknown.returncode == 1 and "unknown tier 'gold'" in unknown.stderr
    assert "give --tier" in run("keys", "create", "--tenant", "acme", env=env).stderr
    created = run("keys", "create", "--tenant", "acme", "--tier", "pro", "--name", "ci", env=env)
    assert created.returncode == 0
    secret = created.stdout.strip()
    assert secret.startswith("sk-sy-") and "shown only this once" in created.stderr
    clash = run("keys", "create", "--tenant", "acme", "--tier", "free", env=env)
    assert clash.returncode == 1 and "tenants set-tier acme free" in clash.stderr

    listing = run("keys", "list", env=env).stdout
    assert "acme" in listing and secret[:12] in listing and secret not in listing
    keys = json.loads(run("keys", "list", "--json", env=env).stdout)
    assert [(k["tenant"], k["tier"], k["name"], k["revoked_at"]) for k in keys] == [("acme", "pro", "ci", None)]
    assert run("keys", "revoke", str(keys[0]["id"]), env=env).returncode == 0
    again = run("keys", "revoke", str(keys[0]["id"]), env=env)
    assert again.returncode == 1 and "already revoked" in again.stderr

    assert run("tenants", "set-tier", "acme", "enterprise", env=env).returncode == 0
    tenants = json.loads(run("tenants", "list", "--json", env=env).stdout)
    assert [(t["name"], t["tier"]) for t in tenants] == [("acme", "enterprise")]


def test_unreachable_database_is_a_clear_error() -> None:
    result = run("db", "upgrade", env={"SWITCHYARD_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
    assert result.returncode == 1
    assert "cannot reach the database" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_settings_are_a_clear_error() -> None:
    result = run("db", "current", env={"SWITCHYARD_POLICY_SOURCE": "git"})
    assert result.returncode == 1
    assert "invalid settings" in result.stderr and "policy_source" in result.stderr


def test_console_users_from_the_command_line(tmp_path: Path, database_url: str) -> None:
    env = {"SWITCHYARD_DATABASE_URL": database_url, "SWITCHYARD_POLICY_FILE": str(ROOT / "policies.yaml")}
    assert run("db", "upgrade", env=env).returncode == 0

    def admin(*args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SWITCHYARD, "admin", *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **env}, input=password)

    made = admin("create-user", "alice", "--role", "operator", "--password-stdin", password="a long passphrase\n")
    assert made.returncode == 0 and "console user alice (operator) created" in made.stdout, made.stderr
    assert "already exists" in admin("create-user", "alice", "--password-stdin", password="another passphrase\n").stderr
    short = admin("create-user", "bob", "--password-stdin", password="short\n")
    assert short.returncode == 1 and "at least 12 characters" in short.stderr
    assert admin("create-user", "bob", "--role", "root", "--password-stdin", password="x" * 12).returncode == 2
    assert admin("set-role", "alice", "admin").returncode == 0
    assert admin("set-password", "alice", "--password-stdin", password="a newer passphrase\n").returncode == 0
    assert admin("disable", "alice").returncode == 0
    (listed,) = admin("users").stdout.splitlines()
    assert listed.split()[:3] == ["alice", "admin", "disabled"]
    assert "a long passphrase" not in made.stdout + made.stderr
    # The command hashes with the settings' profile: the suite's cheapest, or the default when told.
    env["SWITCHYARD_PASSWORD_HASH_PROFILE"] = "rfc9106-low-memory"
    assert admin("create-user", "carol", "--password-stdin", password="a long passphrase\n").returncode == 0
    engine = db.create_db_engine(database_url)
    try:
        with db.session_scope(engine) as session:
            hashes = dict(session.exec(select(AdminUser.username, AdminUser.password_hash)).all())
    finally:
        engine.dispose()
    assert "$m=8,t=1,p=1$" in hashes["alice"] and "$m=65536,t=3,p=4$" in hashes["carol"]
    env["SWITCHYARD_PASSWORD_HASH_PROFILE"] = "bcrypt"
    wrong = admin("create-user", "dave", "--password-stdin", password="a long passphrase\n")
    assert wrong.returncode == 1 and "password_hash_profile" in wrong.stderr, wrong.stderr
