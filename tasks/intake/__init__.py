"""The one way in: every entrance turns a request into a typed refusal or an accepted job here."""
