"""The job commands: `gpuloom submit|scale|jobs|job|cancel|watch|gpus|run`, each module a command
(or a few of one kind) with its own formatting; `common` holds what several of them print."""
