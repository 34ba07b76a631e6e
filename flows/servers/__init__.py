"""What a run starts and leaves for the next: servers and start-up.

``launch`` runs ``posttrain run`` as a program with every start-up acceleration behind one call;
``prefect_server`` is posttrain's own Prefect API server (started on first use, shared, stopped
when idle); ``db_templates`` and ``make_db_templates`` are the migrated empty databases a new
home copies (``shipped_databases/``); ``startup`` runs a program's start-up without garbage
collection; ``warm`` and ``warm_process`` keep a process with the libraries imported to fork
each later run from; ``ui`` serves MLflow's UI on loopback. It may import ``flows.recording``
(the home, its locks) and, for the warm process's runs, ``flows.spec.loading``,
``flows.execution.pipeline`` and ``flows.cli``.
"""
