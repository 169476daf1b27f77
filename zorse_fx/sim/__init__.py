"""Event-driven simulation of a plan's training step (engine.py) and its
visualisation as a Perfetto / Chrome trace or a PNG Gantt chart (trace.py);
check.py checks a planner's answer with it before it becomes a Plan."""

from .check import PlanCheckError, SimulationCheck, check_result
from .engine import SimEvent, SimResult, link_resource, simulate
from .trace import gantt_png, stage_memory, to_perfetto

__all__ = ["SimEvent", "SimResult", "simulate", "link_resource", "to_perfetto", "gantt_png", "stage_memory",
           "check_result", "SimulationCheck", "PlanCheckError"]
