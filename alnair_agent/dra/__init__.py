"""dra: Alnair as a DRA driver (resource.k8s.io/v1 with consumable capacity), the front-end beside the device plugin.

`frontend.py` chooses the front-end and runs this one; `slices.py` publishes the node's ResourceSlice;
`plugin.py` serves kubelet's DRA gRPC API and the plugin-watcher registration; `ledger.py` turns a prepared claim
into allocation folders, regions and limits (the same ledger as the device plugin's); `cdi.py` writes the CDI specs
that give containers their environment and mounts; `capacity.py` and `quantity.py` are the capacity model.
"""
