"""Test doubles that ship with the package, because a Triton model repository loads them by name (the
`engine_loader` parameter): fake_engine.py is a weights-free Engine for glue tests and fault injection."""
