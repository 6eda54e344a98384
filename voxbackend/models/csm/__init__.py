"""Sesame CSM-1B: Llama backbone + depth decoder over Mimi codes; its tiny-checkpoint writer."""
