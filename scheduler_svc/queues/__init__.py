"""The waiting queue's orderings, one class each (request_queue.py builds them by name)."""
