"""Structured outputs: constrain generation to a JSON schema, a regex, a list of choices, an EBNF
grammar or any JSON object (xgrammar backend).

``params.py`` (the request's spec, torch- and xgrammar-free) is imported by SamplingParams;
the rest (compiler, per-request matcher, manager) is imported only by the engine.
"""
