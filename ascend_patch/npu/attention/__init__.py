"""The Ascend attention backends (:mod:`.backend`, :mod:`.mla`, :mod:`.encoder`) on what they
share (:mod:`.base`: the backend's face to vLLM, the impls' constructor, the causal masks),
the paths each layer runs and the KV block size they page with (:mod:`.paths`), and the
KV-cache page layout they read (:mod:`.kv_layout`).

Docs: docs/design.md, "What the overlay does on the NPU" and
"Sliding windows, soft-capping and head sizes".
"""
