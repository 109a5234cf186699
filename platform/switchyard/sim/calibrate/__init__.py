"""``switchyard sim calibrate``: measure a real engine and write a profile the simulator loads.

Owns: the measurements (``facts``: the engine's limits; ``probe``: TTFT against prompt
length, on an idle and on a busy engine, prefix-hit speed-up, ITL against batch size), the fit
of the step-time model (``fit``, pure functions), the comparison of the real engine with a
simulator running the fitted profile on one short replayed workload (``replay``), and the
Markdown report (``report``). ``run`` ties them together; ``client`` is the streaming HTTP
client they share.

Must not touch: the simulator's internals. It talks to engines over HTTP only (the real one,
and a ``switchyard sim`` process it starts for the comparison), and writes profiles through
``switchyard.sim.measured``.
"""

from switchyard.sim.calibrate.client import EngineError
from switchyard.sim.calibrate.report import render_report
from switchyard.sim.calibrate.run import CalibrationOptions, CalibrationResult, calibrate

__all__ = ["CalibrationOptions", "CalibrationResult", "EngineError", "calibrate", "render_report"]
