"""The demo's questions: `llmserve demo` asks them, and the quantization accuracy guard checks
that every mode's greedy answers to them keep their meaning."""

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
]
