package backup

// SealManifest lets tests write the MAC of an edited manifest, as someone
// holding the secret could.
var SealManifest = sealManifest
