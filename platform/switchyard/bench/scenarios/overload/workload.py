"""The ``overload`` scenario's setup: three priority classes with a noisy and a quiet tenant each, their TTFT
SLOs and queue deadlines, the request mix, and the policy of a main pool that downgrades to a small one."""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.bench.stats import Slo
from switchyard.bench.synthetic import RequestTemplate

ARMS = ("flow-control-on", "flow-control-off")
BASELINE = "flow-control-off"
CLASSES = ("critical", "standard", "sheddable")
#: Each class's share of the requests.
CLASS_SHARE = {"critical": 0.2, "standard": 0.4, "sheddable": 0.4}
#: Within each class: the tenants and their shares of the class's requests.
TENANTS = (("noisy", 0.75), ("quiet", 0.25))
#: The TTFT each class is promised (from the scheduled time).
SLO_TTFT_S = {"critical": 1.0, "standard": 2.0, "sheddable": 4.0}
#: The policy's queue deadlines.
MAX_QUEUE_MS = {"critical": 5000, "standard": 1500, "sheddable": 500}
SHED_ABOVE = 0.8
DOWNGRADED_CLASSES = ("standard",)
OVERLOAD = 2.0
MAIN_REPLICAS = 2
SMALL_REPLICAS = 1
MAX_NUM_SEQS = 4
PROFILE = "h100-8b"
MODEL = "chat"
SMALL_MODEL = "chat-lite"
SERVED = "sim-8b"
SMALL_SERVED = "sim-8b-lite"
KV_TOKENS = 100_000
CONTEXT = 8192
PROMPT_TOKENS = (100, 400)
OUTPUT_TOKENS = (16, 48)


def tenant_name(cls: str, kind: str) -> str:
    """The tenant label (and database tenant) of ``kind`` (noisy, quiet) in class ``cls``."""
    return f"{cls}-{kind}"


def slo_spec() -> dict[str, Slo]:
    """The SLO of each class."""
    return {cls: Slo(ttft_s=SLO_TTFT_S[cls]) for cls in CLASSES}


def mix(model: str = MODEL) -> list[RequestTemplate]:
    """The request mix: every class and tenant, streaming, the same lengths."""
    return [RequestTemplate(tenant=tenant_name(cls, kind), request_class=cls, model=model,
                            weight=CLASS_SHARE[cls] * share, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                            stream=True, name=tenant_name(cls, kind))
            for cls in CLASSES for kind, share in TENANTS]


def overload_policy(main_ports: Sequence[int], small_ports: Sequence[int],
                    priority_scheduling: bool = True) -> str:
    """The policy document: two pools, ``chat`` downgrading to ``chat-lite``, three classes and tiers.

    Without ``priority_scheduling`` the engines get no ``priority`` and serve first come, first served.
    """
    scheduling = "true" if priority_scheduling else "false"
    def urls(ports: Sequence[int]) -> str:
        return "[" + ", ".join(f"http://127.0.0.1:{p}" for p in ports) + "]"

    classes = "\n".join(
        f"  {cls}: {{max_queue_ms: {MAX_QUEUE_MS[cls]}"
        + (f", shed_above_utilisation: {SHED_ABOVE:g}" if cls == "sheddable" else "") + "}" for cls in CLASSES)
    tiers = "\n".join(f"  - {{name: {cls}, priority: {cls}, models: [\"*\"]}}" for cls in CLASSES)
    downgraded = ", ".join(DOWNGRADED_CLASSES)
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: main, region: local, served_model: {SERVED}, endpoints: {urls(main_ports)},
      kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE}, max_num_seqs: {MAX_NUM_SEQS},
      priority_scheduling: {scheduling}}}
  - {{name: small, region: local, served_model: {SMALL_SERVED}, endpoints: {urls(small_ports)},
      kv_cache_tokens: {KV_TOKENS}, sim_profile: {PROFILE}, max_num_seqs: {MAX_NUM_SEQS},
      priority_scheduling: {scheduling}}}
models:
  - {{name: {MODEL}, pools: [main], context_window: {CONTEXT}, price: {{input_per_mtok: 3, output_per_mtok: 15}},
      on_saturation: {{downgrade_to: {SMALL_MODEL}, classes: [{downgraded}]}}}}
  - {{name: {SMALL_MODEL}, pools: [small], context_window: {CONTEXT},
      price: {{input_per_mtok: 0.2, output_per_mtok: 0.8}}}}
priorities:
{classes}
tiers:
{tiers}
"""
