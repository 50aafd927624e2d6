"""Parts of ``benchmarks/wan.py``: the workloads (``workload``), the timing loop (``timing``), the
remotorch cases (``cases``), the peers' clients (``peers``) and servers (``servers``), and the report
(``report``)."""
