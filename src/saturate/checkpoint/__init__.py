"""Checkpoints in one place: the files (files.py), the checkpointer that saves during a run
and resumes from them (checkpointer.py, resume.py), and the run directory that holds them,
one run at a time (rundir.py: the lock, starting over, a failure's record).

Nothing is imported here: the run directory's checks (rundir.py) come before torch is
imported, so that a mistake in a command is answered at once."""
