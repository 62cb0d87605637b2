"""Media inputs: the images of a request fetched (``fetch``: data URLs, http(s) with limits,
``file://`` under an allowed folder) and decoded (``decode``: PNG, JPEG, WebP, GIF's first frame, as
RGB, with a content hash); ``processor``: a vision-language model's processor (placeholders expanded,
encoder inputs); ``prompt``: a prompt's images as the engine sees them. Every error is a 400 naming
the image's part.

Import from the modules: ``prompt`` is read by the scheduler and block manager, which must not load
Pillow or httpx, so this package imports none of its modules.
"""
