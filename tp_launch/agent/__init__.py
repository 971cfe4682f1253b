"""The node agent: one per node, it runs and watches this node's workers."""

from tp_launch.agent.launch import run_agent
from tp_launch.agent.node_agent import NodeAgent

__all__ = ["NodeAgent", "run_agent"]
