"""algorithms: the point-to-point algorithms behind ``distlib.comm.collectives``, one module per
collective (``reduce_scatter``, ``all_gather``, ``broadcast``, ``all_reduce``) on the shared
helpers of ``base``. Each function moves bytes for a given ``Comm`` and returns nothing; which one
runs is decided by ``distlib.comm.cost_model`` (or ``algo=``) in ``collectives``, which also
counts and checks the call (``header.collective``).
"""
