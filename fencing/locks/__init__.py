"""Named locks and leader election on the jobs machinery: a lock is a job that is never done."""
