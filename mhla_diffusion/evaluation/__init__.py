"""Quality checks for converted models: FID, teacher/student comparison, attention rank/entropy.

Submodules import diffusers, torchmetrics or matplotlib only when used, so importing this
package stays cheap.
"""
