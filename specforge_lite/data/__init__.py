"""Conversation sources, validation, splitting and chat templating."""
