"""What the benchmarks share, so that each script keeps only its measurement.

The scripts run as ``python benchmarks/NAME.py`` (``benchmarks/`` is then ``sys.path[0]``, in
their spawned workers too), so they import these modules as ``harness.<module>``:

``env``
    what a run measured with: the versions, the machine, the commit, a server's settings;
``cli``
    the options the scripts share (``--repeat``, ``--json``, ``--dir``, ``--durability``,
    the servers' URLs, ``--processes``, ...), each with its script's default and help;
``db``
    the local servers' URLs, the async store's engine, raw ``sqlite3`` connections with the
    store's PRAGMAs, scratch directories and database files, tables filled with ready jobs;
``dbapi``
    driver connections that record or time what reaches the driver (``sqlite3``, psycopg,
    pymysql), and the statements SQLAlchemy sends on an engine;
``measure``
    the spawned worker processes that start a measurement together on a barrier, the timing
    of a run, the rotating order that interleaves measurements;
``report``
    tables, their cells (ranges, medians, verdicts), percentiles, the JSON figures.
"""
