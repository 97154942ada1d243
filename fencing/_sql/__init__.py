"""Private: the tables, every statement the library runs, argument checks, plain values, the
clock in SQL and the database errors' classification. Imports nothing else of the library but
:mod:`fencing._errors` and :mod:`fencing._dialects`.

The statements are built here with Core, each once per table and clock, when first used, one
module per table set: the jobs table's (:mod:`.statements`, with :mod:`.attempts`), the
ownership history's (:mod:`.history`), the fence marks' and idempotency keys' (:mod:`.marks`),
a named lock's waiters' queue (:mod:`.waiters`), and an operator's reads (:mod:`.views`). The
modules that run them (``fencing._store``, ``fencing.overview``, ``fencing.web``) build none
(``tests/databases/test_sql_home.py``). What differs between databases is asked of
:mod:`fencing._dialects`, never read from a dialect's name."""
