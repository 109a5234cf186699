"""The policy document: schema, YAML loading with located errors, and the compiled snapshot.

Owns: what a valid ``policies.yaml`` is and its immutable compiled form. Must not touch: any
other switchyard package, the network, or the database (versions are stored by ``store``).
"""

from switchyard.policy.errors import PolicyError, PolicyIssue
from switchyard.policy.load import parse_policy, read_policy_file
from switchyard.policy.schema import SCHEMA_VERSION, PolicyDocument
from switchyard.policy.snapshot import PolicySnapshot, build_snapshot, compile_policy, policy_sha256

__all__ = [
    "SCHEMA_VERSION",
    "PolicyDocument",
    "PolicyError",
    "PolicyIssue",
    "PolicySnapshot",
    "build_snapshot",
    "compile_policy",
    "parse_policy",
    "policy_sha256",
    "read_policy_file",
]
