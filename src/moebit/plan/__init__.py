"""``moebit plan``: a calibrated alpha-beta performance model of moebit's training.

Predicts what 1-bit optimizers and expert parallelism buy on clusters we do not have:
``spec``/``presets``/``loaders`` describe the model, ``cluster`` the machines,
``collectives`` prices each collective as moebit runs it, ``model`` a whole run,
``calibrate`` measures this machine, ``benchmode`` mirrors ``moebit bench train``.
"""

from moebit.plan.cluster import ClusterSpec
from moebit.plan.model import Setup, compare, predict, schedule
from moebit.plan.spec import ModelSpec, SpecError

__all__ = ["ClusterSpec", "ModelSpec", "Setup", "SpecError", "compare", "predict", "schedule"]
