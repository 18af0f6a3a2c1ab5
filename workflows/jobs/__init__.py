"""A job, from its request to its end. The request made once from ``launch``'s arguments
(``request``) and the job's id and names minted from it (``spec``); the queue that admits it to
workers (``admission``); the launcher that chooses the workers, decides the world size and
bootstraps the process group on them (``launcher``); the controller whose states run its
generations, resizes and recoveries (``controller``) under the failure and scaling policies it
is given (``failure_policy``, ``scaling_policy``). The public ``launch`` of a rank function
(``launch``) or of a torchrun script (``script_launch``), the Dask collections handed to its
ranks (``collections``), the code shipped to the workers (``code_shipping``) and the Ctrl-C that
reaches the caller while it waits (``interrupts``)."""
