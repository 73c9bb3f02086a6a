"""The modules of this kernel's problem, as evoattn evaluated it."""
