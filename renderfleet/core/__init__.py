"""The contract shared by the dispatcher and the workers.

Nothing in here imports torch or diffusers: the dispatcher side must run on
a laptop without them.
"""
