"""Render advice and profiles for people: a rich table, JSON, Markdown, HTML with SVG figures.

``render`` holds the formats ``advise`` prints, ``content`` the words and numbers they share,
``html`` and ``svg`` the HTML report and its figures, ``schedule`` the pipeline timelines it
draws, ``profile_table`` the table of ``stratagem profile``, ``compare`` the side-by-side
comparison of ``stratagem explain``.
"""
