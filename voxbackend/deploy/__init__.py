"""Deployment tools that run outside Triton: the model-repository generator (`configs.py`, `voxbackend configs`)
and the tritonserver launcher (`server.py`, `voxbackend serve`)."""
