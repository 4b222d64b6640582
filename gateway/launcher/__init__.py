"""The launcher: the gateway starts, watches, restarts and stops its api_server backends.

``spawn`` decides what to run (engine, devices, argv, environment), ``process`` runs it in a
process group that cannot outlive the gateway (``guard``), ``supervisor`` drives each instance
through starting, loading, healthy, restarting, and into or out of the pool.
"""

from .spawn import GroupPlan, LaunchError, instance_argv, instance_env, lmdeploy_argv, plan_group, sim_argv
from .supervisor import STATES, Instance, Launcher

__all__ = [
    "GroupPlan",
    "Instance",
    "LaunchError",
    "Launcher",
    "STATES",
    "instance_argv",
    "instance_env",
    "lmdeploy_argv",
    "plan_group",
    "sim_argv",
]
