"""The dispatcher: per GPU, lays out each capped container's turns (a window of its cap's part of a period common to
the GPU) and lends idle GPU time to elastic containers (control.py for the rules, service.py for the loop)."""
