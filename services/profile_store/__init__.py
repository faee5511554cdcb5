"""profile-store: profiles of jobs and kernels in a SQL database behind a read-through cache."""
