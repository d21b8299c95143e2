"""The scheduler's algorithms, below the executors that use them: which prefill-only request runs next
and the job-time models (prefill_only.py: FCFS, SRJF with continuous JCT calibration), how retrieve
requests form batches under a wait quota or an SLO (batching.py), and the multi-stream executor's
work units, stream selection and backends (streams.py). Plain functions and classes: the loop that
drives them is sgrec.scheduler, above the rank and retrieve executors."""
