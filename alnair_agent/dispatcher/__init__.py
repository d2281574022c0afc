"""The dispatcher: per GPU, turns each container's compute cap into the grant line of its region, with feedback
from what the GPU really did (see control.py for the law, service.py for the loop)."""
