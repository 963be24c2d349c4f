"""The compressed backends, collectives and wire: their outputs, devices, faults and MPI runs."""
