"""Sparse-MoE ops: routing and expert computation."""
from linrnn_kernels.moe import naive

route = naive.route
moe_experts = naive.moe_experts
