"""What any all-reduce computes, whoever runs it: wire codecs, aggregation rules, the butterfly's parts.

Neutral ground: the outer-loop math (``algo``), the simulator (``sim``) and the transports (``net``) all use it;
it imports torch and the standard library only.
"""
