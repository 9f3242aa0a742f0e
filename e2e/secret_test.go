package e2e

// e2eSecret is the BETTER_COMPUTE_SECRET of the e2e tests: a generated
// one, since pki init refuses secrets estimated below 128 bits (issue 8
// point 5).
const e2eSecret = "u4Kx8Qm2Zr7Lc0Vn5Jb9Tf3Wh6Yd1Ps8Ag2Ne7Ro4Ci"
